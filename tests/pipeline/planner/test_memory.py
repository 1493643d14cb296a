"""pipeline.planner.memory: stash counts and per-rank activation peaks from a schedule's order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedules
from pipeline.planner.memory import (
    checkpointed,
    optimizer_factor,
    rank_peaks,
    stash_profile,
)
from tests.strategies import schedules_any


@given(schedules_any())
def test_counting_micro_batches_agrees_with_the_simulator(schedule: schedules.Schedule) -> None:
    # One byte per stashed input, nothing saved: the peak is the simulator's count.
    k = schedule.num_microbatches * schedule.num_batches
    peaks = rank_peaks(schedule, [False] * k, [1.0] * schedule.num_stages,
                       [0.0] * schedule.num_stages)
    assert peaks == tuple(float(p) for p in schedules.peak_activations(schedule.actions))


@given(schedules_any(), st.sampled_from(["never", "except_last", "always"]),
       st.lists(st.floats(0, 100), min_size=32, max_size=32),
       st.lists(st.floats(0, 100), min_size=32, max_size=32))
def test_stage_profiles_bound_each_rank(schedule: schedules.Schedule, mode: str,
                                        inputs: list[float], saved: list[float]) -> None:
    rec = checkpointed(mode, schedule.num_microbatches, schedule.num_batches)
    x, g = inputs[:schedule.num_stages], saved[:schedule.num_stages]
    stash = stash_profile(schedule, rec)

    def stage_peak(s: int) -> float:
        return max(a * x[s] + b * g[s] for a, b in stash[s])

    peaks = rank_peaks(schedule, rec, x, g)
    for r in range(schedule.num_ranks):
        own = schedule.stages_of(r)
        assert peaks[r] <= sum(stage_peak(s) for s in own) * (1 + 1e-9) + 1e-9
        for s in own:  # alone on its rank, a stage's bound is exact
            only = [x[t] if t == s else 0.0 for t in range(schedule.num_stages)]
            alone = [g[t] if t == s else 0.0 for t in range(schedule.num_stages)]
            assert rank_peaks(schedule, rec, only, alone)[r] == pytest.approx(stage_peak(s))


def test_recomputation_as_a_table() -> None:
    # 1F1B, p=2, m=4, rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3. Without recomputation it holds two
    # micro-batches' inputs and graphs; recomputing all of them, two inputs and one replayed
    # graph at a time; except_last keeps micro-batch 3's graph from its forward on, so B2's
    # replay makes two graphs again.
    s = schedules.get_schedule("1f1b", 2, 4)
    assert stash_profile(s, checkpointed("never", 4))[0] == ((2, 2),)
    assert stash_profile(s, checkpointed("always", 4))[0] == ((2, 1),)
    assert stash_profile(s, checkpointed("except_last", 4))[0] == ((2, 2),)
    assert rank_peaks(s, checkpointed("never", 4), [10, 10], [100, 100]) == (220, 110)
    assert rank_peaks(s, checkpointed("always", 4), [10, 10], [100, 100]) == (120, 110)
    # Split backward: a replayed graph lives from I to W (zb-h1 defers W's).
    z = schedules.get_schedule("zb-h1", 2, 4)
    assert max(rank_peaks(z, checkpointed("always", 4), [0, 0], [1, 1])) >= 1


def test_optimizer_state() -> None:
    assert optimizer_factor("adam") == (2.0, 4)  # exp_avg, exp_avg_sq; a float32 step each
    assert optimizer_factor("sgd") == (0.0, 0)
    assert optimizer_factor(1.5) == (1.5, 0)
    with pytest.raises(ValueError, match="must be one of"):
        optimizer_factor("lion")
    with pytest.raises(ValueError, match=">= 0"):
        optimizer_factor(-1)
    assert checkpointed("except_last", 3, 2) == [True, True, False, True, True, False]
