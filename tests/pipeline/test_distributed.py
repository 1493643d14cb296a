"""Multi-process pipelines: 2 to 4 gloo ranks on loopback, against the single-device model."""

from __future__ import annotations

import pytest

from pipeline.launch import RankFailed, spawn
from tests.pipeline import dist_workers

pytestmark = pytest.mark.dist

SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw", "zb-h1")
MODES = ("never", "except_last", "always")


@pytest.mark.timeout(300)
def test_two_ranks_every_schedule_and_mode() -> None:
    combos = [(s, c) for s in SCHEDULES for c in MODES]
    balances = {s: [2, 2, 2, 2] if s == "interleaved" else [4, 4] for s in SCHEDULES}
    assert spawn(dist_workers.equivalence, 2, combos, balances, timeout=280) == [30, 30]


@pytest.mark.timeout(300)
def test_three_and_four_ranks() -> None:
    combos = [(s, "except_last") for s in SCHEDULES]
    three = {s: [1, 1, 1, 1, 2, 2] if s == "interleaved" else [3, 3, 2] for s in SCHEDULES}
    assert spawn(dist_workers.equivalence, 3, combos, three, timeout=140) == [10] * 3
    four = {s: [1] * 8 if s == "interleaved" else [2, 2, 2, 2] for s in SCHEDULES}
    combos = [("1f1b", "always"), ("zb-h1", "never"), ("interleaved", "never")]
    assert spawn(dist_workers.equivalence, 4, combos, four, timeout=140) == [6] * 4


def test_integer_inputs() -> None:
    losses = spawn(dist_workers.integer_inputs, 2, timeout=60)
    assert losses[0] == losses[1]  # every rank returns the loss


def test_2bw_many_batches_across_processes() -> None:
    results = spawn(dist_workers.two_bw_many, 3, timeout=60)
    assert results[0] == results[1] == results[2]


def test_meta_device_and_full_checkpoint() -> None:
    keys = spawn(dist_workers.meta_and_checkpoint, 3, timeout=60)
    # Balance [3, 2, 3]: each rank holds (and keys) only its layers, named as in the model.
    assert keys == [["0.bias", "0.weight", "2.bias", "2.weight"], ["4.bias", "4.weight"],
                    ["5.bias", "5.weight", "7.bias", "7.weight"]]


def test_exception_in_a_middle_rank_reaches_every_rank() -> None:
    results = spawn(dist_workers.failing_middle, 3, "raise", timeout=60)
    for rank, (message, seconds) in enumerate(results):
        assert "rank 1 (cpu) failed at 1F3 (forward of stage 1, micro-batch 3)" in message, rank
        assert "ValueError: bad micro-batch" in message
        assert seconds < 20, (rank, seconds)


def test_killed_rank_is_named_by_the_others() -> None:
    with pytest.raises(RankFailed) as err:
        spawn(dist_workers.failing_middle, 3, "kill", timeout=60)
    assert "rank 1: process died" in str(err.value)
    survivors = err.value.results
    assert sorted(survivors) == [0, 2]
    for rank, (message, seconds) in survivors.items():
        assert "rank 1" in message, (rank, message)
        assert seconds < 20, (rank, seconds)
