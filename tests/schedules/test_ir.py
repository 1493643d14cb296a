import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedules import Action, Op, Schedule, ScheduleError, from_text, to_text
from tests.strategies import schedules_any


@given(st.integers(0, 999), st.sampled_from(list(Op)), st.integers(0, 999),
       st.none() | st.integers(0, 9))
def test_action_text_round_trips(stage: int, op: Op, mb: int, version: int | None) -> None:
    a = Action(stage, op, mb, version)
    assert Action.parse(str(a)) == a


def test_action_text_is_torch_compact_form() -> None:
    assert str(Action(2, Op.F, 0)) == "2F0"
    assert str(Action(1, Op.SEND_B, 3)) == "1SEND_B3"
    assert str(Action(0, Op.F, 5, 1)) == "0F5v1"
    assert Action.parse(" 3RECV_F12 ") == Action(3, Op.RECV_F, 12)


@pytest.mark.parametrize("bad", ["", "F0", "2X0", "2F", "-1F0", "2F0v", "2F0 1B0"])
def test_action_parse_errors_name_the_format(bad: str) -> None:
    with pytest.raises(ScheduleError, match="expected <stage><op><micro-batch>"):
        Action.parse(bad)


def test_schedule_checks_its_shape() -> None:
    with pytest.raises(ScheduleError, match="multiple of num_ranks"):
        Schedule(2, 3, 1, ((), ()))
    with pytest.raises(ScheduleError, match="one list per rank"):
        Schedule(2, 2, 1, ((),))
    with pytest.raises(ScheduleError, match="placement must be one of"):
        Schedule(1, 1, 1, ((),), placement="ring")
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive int"):
        Schedule(1, 1, 0, ((),))


def test_v_placement_zig_zags() -> None:
    s = Schedule(3, 9, 1, ((), (), ()), placement="v")
    assert [s.rank_of(i) for i in range(9)] == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert s.stages_of(0) == (0, 5, 6)
    loop = Schedule(3, 6, 1, ((), (), ()))
    assert [loop.rank_of(i) for i in range(6)] == [0, 1, 2, 0, 1, 2]


@given(schedules_any())
def test_text_round_trips(schedule: Schedule) -> None:
    assert from_text(to_text(schedule)) == schedule


def test_text_errors() -> None:
    with pytest.raises(ScheduleError, match="must start with"):
        from_text("rank 0: 0F0")
    with pytest.raises(ScheduleError, match="expected line 'rank 1"):
        from_text("schedule name=x ranks=2 stages=2 microbatches=1\nrank 0: 0F0 0B0\nrank 3: 1F0")
