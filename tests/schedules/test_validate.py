import sys
from collections.abc import Callable
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules
from schedules import Action, Op, Schedule, ScheduleError
from schedules.graph import Deadlock, execute
from schedules.planned import plan
from tests.strategies import mutated_schedules, schedules_any

validate_module = sys.modules["schedules.validate"]  # the package exports the function by name


def _schedule(*rows: str, stages: int | None = None, m: int = 1, **kw: object) -> Schedule:
    parsed = tuple(tuple(Action.parse(c) for c in row.split()) for row in rows)
    return Schedule(len(rows), stages or len(rows), m, parsed, **kw)  # type: ignore[arg-type]


@given(schedules_any())
def test_every_generator_validates_and_simulates(schedule: Schedule) -> None:
    assert schedules.validate(schedule) is schedule
    lowered = schedules.lower(schedule)
    schedules.validate(lowered)
    # Lowering adds only communication; timing with zero latency is unchanged.
    assert schedules.simulate(lowered).makespan == schedules.simulate(schedule).makespan
    assert lowered.compute_only() == schedule


def test_missing_backward() -> None:
    with pytest.raises(ScheduleError, match="missing backward for stage 1 micro-batch 0"):
        schedules.validate(_schedule("0F0 0B0", "1F0"))


def test_missing_forward() -> None:
    with pytest.raises(ScheduleError, match="missing forward 1F0"):
        schedules.validate(_schedule("0F0 0B0", "1B0"))


def test_duplicate_is_marked_in_the_grid() -> None:
    with pytest.raises(ScheduleError) as err:
        schedules.validate(_schedule("0F0 0F0 0B0"))
    text = str(err.value)
    assert "0F0 appears more than once" in text
    assert ">0F0<" in text and "rank 0" in text


def test_wrong_rank() -> None:
    with pytest.raises(ScheduleError, match="stage 1 is placed on rank 1"):
        schedules.validate(_schedule("0F0 1F0 1B0 0B0", ""))


def test_backward_before_forward_is_a_deadlock_with_the_step_marked() -> None:
    with pytest.raises(ScheduleError) as err:
        schedules.validate(_schedule("0B0 0F0"))
    text = str(err.value)
    assert "deadlock" in text and "rank 0 step 0 (0B0) waits for 0F0" in text
    assert ">0B0<" in text


def test_cross_rank_deadlock() -> None:
    # Rank 0 waits for rank 1's gradient of micro-batch 0 before sending micro-batch 1's forward,
    # while rank 1 runs micro-batch 1's forward before micro-batch 0's backward.
    bad = _schedule("0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1", m=2)
    with pytest.raises(ScheduleError, match=r"rank 1 step 0 \(1F1\) waits for 0F1"):
        schedules.validate(bad)


def test_split_backward_rules() -> None:
    schedules.validate(_schedule("0F0 0I0 0W0"))
    with pytest.raises(ScheduleError, match="waits for 0I0"):
        schedules.validate(_schedule("0F0 0W0 0I0"))
    with pytest.raises(ScheduleError, match="both B and I/W"):
        schedules.validate(_schedule("0F0 0B0 0I0 0W0"))
    with pytest.raises(ScheduleError, match="no 0W0"):
        schedules.validate(_schedule("0F0 0I0"))


def test_out_of_range() -> None:
    with pytest.raises(ScheduleError, match="stage 2 >= num_stages 2"):
        schedules.validate(_schedule("0F0 2F0", ""))
    with pytest.raises(ScheduleError, match="micro-batch 1 is out of range"):
        schedules.validate(_schedule("0F0 0B0 0F1"))


def test_lowered_receive_after_its_consumer_deadlocks() -> None:
    good = schedules.lower(schedules.get_schedule("gpipe", 2, 1))
    rows = [list(r) for r in good.actions]
    rows[1] = [rows[1][1], rows[1][0], *rows[1][2:]]  # F before its RECV_F
    with pytest.raises(ScheduleError, match="deadlock"):
        schedules.validate(good.replace(actions=tuple(map(tuple, rows))))


def test_error_carries_reason_and_marks_for_tools() -> None:
    with pytest.raises(ScheduleError) as err:
        schedules.validate(_schedule("0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1", m=2))
    assert err.value.marks == {0: 1, 1: 0}
    # The reason is the rule and the blocked steps, without the grid.
    assert "rank 0 step 1 (0B0) waits for 1B0" in err.value.reason
    assert ">0B0<" not in err.value.reason and ">0B0<" in str(err.value)
    assert "\n" + schedules.format_grid(
        _schedule("0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1", m=2), {0: 1, 1: 0}) in str(err.value)


def _outcome(schedule: Schedule) -> object:
    try:
        return schedules.validate(schedule)
    except ScheduleError as exc:
        return str(exc), exc.reason, exc.marks


def _by_key(schedule: Schedule, duration: Callable[[Op, int], float],
            latency: float = 0.0) -> tuple[list[list[float]], list[list[float]]] | Deadlock:
    return execute(schedule, lambda a: duration(a.op, a.stage), latency)


@settings(max_examples=400)
@given(mutated_schedules())
def test_the_fast_tests_agree_with_the_step_by_step_checks(schedule: Schedule) -> None:
    # Each check's fast test may only pass a schedule the check passes; the validator must
    # report the same first error, grid and marks with the fast tests as without them.
    got = _outcome(schedule)
    with mock.patch.object(validate_module, "_actions_ok", lambda *_: False), \
            mock.patch.object(validate_module, "_complete_ok", lambda *_: False), \
            mock.patch.object(validate_module, "_comms_ok", lambda *_: False), \
            mock.patch.object(validate_module, "execute_by_kind", _by_key):
        assert _outcome(schedule) == got


def test_a_stage_mixing_b_and_i_needs_each_w_with_its_i() -> None:
    # Stage 3 runs 3I0 3W0 and B for the rest; moving the W to micro-batch 1 leaves 3I0 without
    # one and gives 3B1 a W too.
    good = schedules.get_schedule("dualpipe-v", 2, 4)
    rows = [list(row) for row in good.actions]
    rows[0][5] = Action(3, Op.W, 1)
    with pytest.raises(ScheduleError, match="stage 3 micro-batch 0: need 3B0, or both 3I0 and "
                       "3W0"):
        schedules.validate(good.replace(actions=tuple(map(tuple, rows))))


@given(schedules_any(), st.booleans())
def test_every_generated_schedule_passes_the_fast_tests(schedule: Schedule,
                                                        lowered: bool) -> None:
    # So validating one never falls back to the step-by-step checks.
    if lowered:
        schedule = schedules.lower(schedule)
    found = plan(schedule)
    assert validate_module._actions_ok(schedule, found)
    assert validate_module._complete_ok(schedule, found)
    assert not lowered or validate_module._comms_ok(schedule, found)


def test_a_send_and_receive_within_a_rank_is_refused() -> None:
    # ZB-V holds stages 1 and 2 on rank 1 of 2: activations pass between them in memory.
    lowered = schedules.lower(schedules.get_schedule("zb-v", 2, 1))
    row = list(lowered.actions[1])
    row.insert(row.index(Action(1, Op.F, 0)) + 1, Action(1, Op.SEND_F, 0))
    row.insert(row.index(Action(2, Op.F, 0)), Action(2, Op.RECV_F, 0))
    with pytest.raises(ScheduleError, match="1SEND_F0: stages 1 and 2 are both on rank 1"):
        schedules.validate(lowered.replace(actions=(lowered.actions[0], tuple(row))))
