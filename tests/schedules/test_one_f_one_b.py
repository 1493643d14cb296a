from hypothesis import given

import schedules
from tests.schedules.tables import rows
from tests.strategies import schedule_args


def test_p3_m4() -> None:
    assert rows("1f1b", 3, 4) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_p2_m2() -> None:
    assert rows("1f1b", 2, 2) == ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]


def test_fewer_microbatches_than_ranks() -> None:
    # torch needs m >= p; here m < p just shortens the steady state.
    assert rows("1f1b", 3, 2) == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2B0 2F1 2B1"]


@given(schedule_args("1f1b"))
def test_bubble_and_memory(args: tuple[str, int, int, dict[str, int]]) -> None:
    _, p, m, _ = args
    t = schedules.simulate(schedules.validate(schedules.get_schedule("1f1b", p, m)))
    assert t.bubble_fraction == (p - 1) / (m + p - 1)
    assert t.peak_activations == tuple(min(m, p - r) for r in range(p))
