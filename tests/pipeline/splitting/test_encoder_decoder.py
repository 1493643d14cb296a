"""Encoder-decoders split from their graphs train exactly under every schedule, the ones that
split the backward in two included: BART and T5, whose stages hand on values that never meet
the stage's incoming activations (the decoder's embeddings beside the encoder's output, T5's
relative position biases) and share one embedding between encoder, decoder and head."""

from __future__ import annotations

import functools

import pytest

import schedules
from pipeline import Pipe
from tests.models_traced import (
    Case,
    Record,
    assert_same_training,
    bart_case,
    exports_reused,
    pipe_steps,
    reference_steps,
    t5_case,
)

CASES = {"bart": bart_case, "t5": t5_case}
# One stage per rank: the encoder's second layer with the decoder's embeddings (and, for T5,
# the decoder's first block making its position bias). Two per rank: one more cut.
SPLITS = {
    ("bart", 1): ["model.encoder.layers.1", "model.decoder.layers.0"],
    ("bart", 2): ["model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1"],
    ("t5", 1): ["encoder.block.1", "decoder.block.1"],
    ("t5", 2): ["encoder.block.1", "decoder.block.0", "decoder.block.1"],
}
SCHEDULES = ["1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v"]


@functools.cache
def _case(name: str) -> Case:
    return CASES[name]()


@functools.cache
def _reference(name: str) -> Record:
    return reference_steps(_case(name))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(CASES))
def test_encoder_decoder_trains_exactly(name: str, schedule: str) -> None:
    """Three AdamW steps: every loss, every gradient (the decoder's positions and embedding
    LayerNorm, T5's relative attention biases, the shared embedding) and every weight after
    each step equal the unsplit model's."""
    case = _case(name)
    per_rank = schedules.info(schedule).stages_per_rank
    points = SPLITS[(name, per_rank)]
    model = case.model()
    with exports_reused():
        pipe = Pipe(model, example_inputs=case.inputs, split_points=points,
                    devices=["cpu"] * ((len(points) + 1) // per_rank), chunks=4,
                    schedule=schedule, checkpoint="except_last")
    try:
        got = pipe_steps(pipe, model, case)
    finally:
        pipe.close()
    assert_same_training(got, _reference(name))
