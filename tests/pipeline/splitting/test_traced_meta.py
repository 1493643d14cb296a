"""A model split on the meta device: its graph follows the stage's device, and a weight two
modules of one stage share stays shared when the stage is materialised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.comm.bootstrap import materialize
from tests.models_traced import (
    Case,
    assert_same_training,
    bert_case,
    gpt2_case,
    llama_case,
    pipe_steps,
    reference_steps,
)

pytest.importorskip("transformers")


def _on_meta(case: Case) -> nn.Module:
    with torch.device("meta"):
        return case.model()


def _rotary_tables(module: nn.Module) -> None:
    """Weights come from load_state_dict; Llama's rotary tables (`inv_freq`) are
    non-persistent buffers no state_dict holds, so they are computed here."""
    if hasattr(module, "inv_freq"):
        fresh = type(module)(module.config)  # type: ignore[operator]
        for key, value in fresh.named_buffers():
            getattr(module, key).copy_(value)


@pytest.mark.parametrize("case", [gpt2_case(), llama_case()], ids=lambda c: c.name)
def test_a_model_traced_on_meta_trains_as_the_plain_one(case: Case) -> None:
    """Export writes the traced device into the graph (`arange(device=meta)`, `to(meta)`):
    before the stages took their inputs' device, the first step failed with "Tensor device
    mismatch! Expected: meta, Got: cpu"; and GPT-2's embedding and head, one meta tensor in
    the first stage, became two Parameters, so the head's gradient never reached the
    embedding."""
    model = _on_meta(case)
    meta_inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
                   for k, v in case.inputs.items()}
    pipe = Pipe(model, example_inputs=meta_inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4, param_init=_rotary_tables)
    assert all(t.device.type == "cpu" for t in [*pipe.parameters(), *pipe.buffers()])
    pipe.load_state_dict(case.model().state_dict())
    # The optimizer over the Pipe's Parameters: the meta model's own were replaced by real
    # ones in the stages (as for an nn.Sequential built on meta).
    got = pipe_steps(pipe, pipe, case)
    assert_same_training(got, reference_steps(case))
    pipe.close()


def test_materialising_keeps_a_weight_shared_inside_a_layer() -> None:
    with torch.device("meta"):
        embed, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        head.weight = embed.weight
        layer = nn.ModuleDict({"embed": embed, "head": head})
    materialize(layer, torch.device("cpu"), name="0", param_init="reset")
    assert layer["head"].weight is layer["embed"].weight
    assert not layer["head"].weight.is_meta


def test_skipping_initialisation_warns_of_buffers_no_state_dict_holds() -> None:
    case = llama_case()
    model = _on_meta(case)
    meta_inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v
                   for k, v in case.inputs.items()}
    with pytest.warns(UserWarning, match=r"non-persistent buffers \['model.rotary_emb.inv_freq"):
        Pipe(model, example_inputs=meta_inputs, split_points=[case.blocks[2]],
             devices=["cpu", "cpu"], param_init="skip").close()


def test_a_name_no_stage_reads_makes_no_tie() -> None:
    """BERT's `cls.predictions.bias` is `decoder.bias`: the graph reads it as the latter, in
    the last stage. The unread name once went to the first stage, making a tie whose owner
    never used the weight (across processes under zb-v its update was lost)."""
    case = bert_case()
    pipe = Pipe(case.model(), example_inputs=case.inputs, split_points=case.blocks[1:],
                devices=["cpu", "cpu"], schedule="zb-v")
    assert [(t.key, [c.stage for c in t.copies]) for t in pipe._ties] == [
        ("bert.embeddings.word_embeddings.weight", [3])]
    last = pipe.partitions[3][0]
    assert last.cls.predictions.bias is last.cls.predictions.decoder.bias
    pipe.close()
