from hypothesis import given

import schedules
from tests.schedules.tables import rows
from tests.strategies import schedule_args


def test_p2_m3() -> None:
    assert rows("gpipe", 2, 3) == [
        "0F0 0F1 0F2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
    ]


def test_p3_m2() -> None:
    assert rows("gpipe", 3, 2) == [
        "0F0 0F1 0B0 0B1",
        "1F0 1F1 1B0 1B1",
        "2F0 2F1 2B0 2B1",
    ]


def test_timeline_p2_m2() -> None:
    # Unit F, B = 2F: rank 1 starts one step late, rank 0 waits for rank 1's backwards.
    t = schedules.simulate(schedules.get_schedule("gpipe", 2, 2))
    assert [(str(e.action), e.start, e.end) for e in t.lane(0)] == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 5, 7), ("0B1", 7, 9)]
    assert [(str(e.action), e.start, e.end) for e in t.lane(1)] == [
        ("1F0", 1, 2), ("1F1", 2, 3), ("1B0", 3, 5), ("1B1", 5, 7)]
    assert t.makespan == 9


@given(schedule_args("gpipe"))
def test_bubble_and_memory(args: tuple[str, int, int, dict[str, int]]) -> None:
    _, p, m, _ = args
    t = schedules.simulate(schedules.validate(schedules.get_schedule("gpipe", p, m)))
    assert t.bubble_fraction == (p - 1) / (m + p - 1)
    assert t.peak_activations == (m,) * p
