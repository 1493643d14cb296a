"""`schedule="auto"`: every synthesised schedule validates, fits its memory limit and is never
simulated slower than the best fixed one-stage-per-rank schedule within that limit."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

import schedules
from schedules import Costs, Op, ScheduleError
from schedules.auto import search, synthesize
from tests.strategies import auto_problems


def _best_fixed(p: int, m: int, costs: Costs, limit: int | None) -> float | None:
    """The least simulated makespan over the registry's fixed schedules with one stage per
    rank whose peak fits `limit`: found here from the registry alone, not through auto."""
    best = None
    for name in schedules.available():
        gen = schedules.info(name)
        if name == "auto" or gen.options or gen.stages_per_rank != 1:
            continue
        s = schedules.get_schedule(name, p, m)
        if s.placement != "loop" or s.num_stages != p:
            continue
        if max(schedules.peak_activations(s.actions)) > (limit or m):
            continue
        t = schedules.simulate(s, costs).makespan
        best = t if best is None else min(best, t)
    return best


@given(problem=auto_problems())
def test_auto_validates_and_is_never_slower_than_a_fixed_schedule(
        problem: tuple[int, int, Costs, int | None]) -> None:
    p, m, costs, limit = problem
    s = synthesize(p, m, costs, memory_limit=limit)
    schedules.validate(s)
    schedules.validate(schedules.lower(s))  # deadlock-free with blocking receives
    assert (s.num_ranks, s.num_stages, s.num_microbatches, s.name) == (p, p, m, "auto")
    timeline = schedules.simulate(s, costs)
    assert max(timeline.peak_activations) <= (limit or m)
    fixed = _best_fixed(p, m, costs, limit)
    if fixed is not None:
        assert timeline.makespan <= fixed


def test_unequal_stages_beat_every_fixed_schedule() -> None:
    # Stages of unequal cost and W's unlike their I's: a list schedule placed for them beats
    # every fixed order (6% here), under the same memory limit.
    costs = Costs(forward=[2, 1, 3, 1], backward_input=[2, 1, 3, 1],
                  backward_weight=[1, 2, 1, 3], backward=[3, 3, 4, 4], comm=0.3)
    found = search(4, 8, costs, memory_limit=4)
    assert found.best_fixed is not None
    assert found.makespan < 0.96 * found.best_fixed[1]
    assert found.chosen.startswith("greedy(")
    assert schedules.simulate(found.schedule, costs).makespan == found.makespan


def test_equal_stages_give_zb_h1() -> None:
    # Unit costs, 1F1B's memory: zb-h1's 3m + p - 1 is the least possible, and a fixed
    # schedule wins every tie.
    for p, m in ((2, 3), (4, 8), (3, 2)):
        auto = schedules.get_schedule("auto", p, m)
        assert auto.actions == schedules.get_schedule("zb-h1", p, m).actions
        assert auto.name == "auto"


def test_memory_limit_one_runs_microbatches_one_at_a_time() -> None:
    s = synthesize(3, 4, memory_limit=1)
    assert schedules.peak_activations(s.actions) == (1, 1, 1)
    for row in s.actions:  # no fixed schedule holds only one: the heuristic's own
        ops = [a.op for a in row]
        assert ops == [Op.F, Op.I, Op.W] * 4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_ranks": 0}, r"auto: num_ranks must be an int >= 1 \(got 0\)"),
    ({"num_microbatches": 2.0}, r"auto: num_microbatches must be an int >= 1 \(got 2.0\)"),
    ({"memory_limit": 0}, r"memory_limit must be an int >= 1 or one such int per rank \(3\) "
                          r"\(got 0\)"),
    ({"memory_limit": [2, 2]}, r"one such int per rank \(3\) \(got \[2, 2\]\)"),
    ({"costs": Costs(forward=[1, 2])}, r"Costs.forward gives 2 values for 3 stages"),
    ({"costs": "F=1"}, r"costs must be a schedules.Costs \(got str\)"),
])
def test_bad_input_names_the_rule(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"num_ranks": 3, "num_microbatches": 4, **kwargs}
    with pytest.raises(ScheduleError, match=message):
        synthesize(**args)
