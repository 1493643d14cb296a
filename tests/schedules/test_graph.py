from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

import schedules
from schedules import Action, Costs, Op, Schedule
from schedules.graph import execute
from schedules.planned import execute_by_kind, plan
from tests.strategies import mutated_schedules, schedules_any

# Durations by (op, stage): the simulator's cost models, a negative one (the plan assumes none)
# and one too short for the higher stages (it raises where the first such action runs).
_DURATIONS: list[tuple[Callable[[Op, int], float], float]] = [
    (Costs().of, 0.0),
    (Costs(forward=1.5, backward=2.5, backward_input=0.75, backward_weight=1.25, update=0.5,
           comm=0.25).of, 0.25),
    (Costs(forward=tuple(range(1, 20)), backward=0.0, comm=1.0).of, 1.0),
    (lambda op, stage: -1.0 if op is Op.W else 1.0 + stage, 0.5),
    (Costs(forward=(1.0, 2.0)).of, 0.0),
]


def _outcome(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except (ValueError, IndexError) as exc:  # a cost missing for a stage; a stage out of range
        return (type(exc), str(exc))


@settings(max_examples=400)
@given(mutated_schedules(), st.sampled_from(_DURATIONS))
def test_execute_by_kind_is_execute(schedule: Schedule,
                                    durations: tuple[Callable[[Op, int], float], float]) -> None:
    duration, latency = durations
    want = _outcome(lambda: execute(schedule, lambda a: duration(a.op, a.stage), latency))
    assert _outcome(lambda: execute_by_kind(schedule, duration, latency)) == want


@given(schedules_any(), st.booleans())
def test_every_generated_schedule_has_a_plan(schedule: Schedule, lowered: bool) -> None:
    # The fast path covers every generator, lowered or not.
    if lowered:
        schedule = schedules.lower(schedule)
    found = plan(schedule)
    assert found is not None
    assert found.offsets[-1] == len(found.kinds) == sum(map(len, schedule.actions))


def test_the_last_plan_is_kept_for_its_schedule_only() -> None:
    s = schedules.get_schedule("1f1b", 3, 4)
    assert plan(s) is plan(s)
    copy = s.replace()
    assert copy == s and plan(copy) is not plan(s)


def test_a_prerequisite_after_its_waiter_on_the_same_rank_leaves_no_plan() -> None:
    s = Schedule(1, 1, 1, ((Action(0, Op.B, 0), Action(0, Op.F, 0)),))
    assert plan(s) is None
    assert execute_by_kind(s, Costs().of) == execute(s, lambda a: Costs().of(a.op, a.stage))


def test_a_gradient_comes_from_i_where_a_micro_batch_has_both_b_and_i() -> None:
    # Invalid (validate refuses it), but simulated as `prerequisites` states: I, not B.
    rows = ("0F0 0B0", "1F0 1B0 1I0 1W0")
    s = Schedule(2, 2, 1, tuple(tuple(Action.parse(c) for c in row.split()) for row in rows))
    want = execute(s, lambda a: Costs().of(a.op, a.stage))
    assert execute_by_kind(s, Costs().of) == want
    assert not isinstance(want, tuple) or want[0][0][1] == 5.0  # after 1I0 ends, not 1B0
