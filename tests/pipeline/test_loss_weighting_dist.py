"""Loss weighting over processes: padded labels over 2 gloo ranks and over a dp x pp 2 x 2 mesh."""

from __future__ import annotations

import importlib.util

import pytest

import schedules
from tests.pipeline import loss_workers
from tests.pipeline.in_turn import InTurn, in_turn, ranks

pytestmark = pytest.mark.dist


def _combos() -> list[tuple[str, str, list[int]]]:
    """Every schedule once (8 layers over 2 ranks), recomputation modes in turn."""
    modes = ("never", "except_last", "always")
    out = []
    for i, name in enumerate(schedules.available()):
        k = schedules.info(name).stages_per_rank
        out.append((name, modes[i % 3], [4 // k + (j < 4 % k) for _ in range(2)
                                         for j in range(k)]))
    return out


MODEL_LOSS_RUNS = [("llama", "1f1b"), ("gpt2", "zb-h1"), ("gpt2", "1f1b"), ("llama", "zb-h1")]
DP_SCHEDULES = ["1f1b", "zb-h1"]
TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# The scenarios on one set of 2 ranks, and those on one set of 4, in turn (see
# tests/pipeline/in_turn.py): each set of ranks starts once. Hugging Face models only where
# transformers is installed (their tests skip otherwise).
two_ranks = ranks("two_ranks", 2, [
    ("every schedule", loss_workers.padded_labels_pp, (_combos(),)),
    ("flattening head", loss_workers.flattened_head, ()),
    *([("model loss", loss_workers.model_loss_pp, (MODEL_LOSS_RUNS,))] if TRANSFORMERS else []),
])
four_ranks = ranks("four_ranks", 4, [
    ("padded dp", loss_workers.padded_labels_dp, (DP_SCHEDULES,)),
    *([("model loss dp", loss_workers.model_loss_dp, (MODEL_LOSS_RUNS,))]
      if TRANSFORMERS else []),
])


@in_turn
def test_padded_labels_over_two_processes_every_schedule(two_ranks: InTurn) -> None:
    assert two_ranks("every schedule") == [2 * len(_combos())] * 2


@pytest.mark.slow
@in_turn
def test_padded_labels_on_a_2x2_mesh_use_the_global_token_count(four_ranks: InTurn) -> None:
    assert four_ranks("padded dp") == [2 * len(DP_SCHEDULES)] * 4


@in_turn
def test_a_flattening_head_trains_over_processes(two_ranks: InTurn) -> None:
    losses = two_ranks("flattening head")
    assert losses[0] == losses[1]


@in_turn
def test_a_traced_models_own_loss_over_two_processes(two_ranks: InTurn) -> None:
    """`labels=` in the inputs and `lambda out, y: out.loss`, no loss_weight=: exact."""
    pytest.importorskip("transformers")
    checked = two_ranks("model loss")
    assert all(c > 0 for c in checked), checked


@pytest.mark.slow
@in_turn
def test_a_traced_models_own_loss_on_a_2x2_mesh_uses_the_global_token_count(
        four_ranks: InTurn) -> None:
    pytest.importorskip("transformers")
    checked = four_ranks("model loss dp")
    assert all(c > 0 for c in checked), checked
