import pytest
from hypothesis import given

import schedules
from schedules import Action, Schedule, ScheduleError
from tests.strategies import schedules_any


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
