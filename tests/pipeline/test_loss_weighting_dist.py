"""Loss weighting over processes: padded labels over 2 gloo ranks and over a dp x pp 2 x 2 mesh."""

from __future__ import annotations

import pytest

import schedules
from pipeline.launch import spawn
from tests.limits import SPAWN_TIMEOUT
from tests.pipeline import loss_workers

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


def test_padded_labels_over_two_processes_every_schedule() -> None:
    combos = _combos()
    assert spawn(loss_workers.padded_labels_pp, 2, combos,
                 timeout=SPAWN_TIMEOUT) == [2 * len(combos)] * 2


@pytest.mark.slow
def test_padded_labels_on_a_2x2_mesh_use_the_global_token_count() -> None:
    names = ["1f1b", "zb-h1"]
    assert spawn(loss_workers.padded_labels_dp, 4, names,
                 timeout=SPAWN_TIMEOUT) == [2 * len(names)] * 4


def test_a_flattening_head_trains_over_processes() -> None:
    losses = spawn(loss_workers.flattened_head, 2, timeout=SPAWN_TIMEOUT)
    assert losses[0] == losses[1]


MODEL_LOSS_RUNS = [("llama", "1f1b"), ("gpt2", "zb-h1"), ("gpt2", "1f1b"), ("llama", "zb-h1")]


def test_a_traced_models_own_loss_over_two_processes() -> None:
    """`labels=` in the inputs and `lambda out, y: out.loss`, no loss_weight=: exact."""
    pytest.importorskip("transformers")
    checked = spawn(loss_workers.model_loss_pp, 2, MODEL_LOSS_RUNS, timeout=SPAWN_TIMEOUT)
    assert all(c > 0 for c in checked), checked


@pytest.mark.slow
def test_a_traced_models_own_loss_on_a_2x2_mesh_uses_the_global_token_count() -> None:
    pytest.importorskip("transformers")
    checked = spawn(loss_workers.model_loss_dp, 4, MODEL_LOSS_RUNS, timeout=SPAWN_TIMEOUT)
    assert all(c > 0 for c in checked), checked
