from hypothesis import given

import schedules
from schedules import Op
from tests.schedules.tables import rows
from tests.strategies import schedule_args


def test_p3_m4() -> None:
    assert rows("zb-h1", 3, 4) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1W0 1F2 1I1 1W1 1F3 1I2 1W2 1I3 1W3",
        "2F0 2I0 2W0 2F1 2I1 2W1 2F2 2I2 2W2 2F3 2I3 2W3",
    ]


def test_p2_m2() -> None:
    assert rows("zb-h1", 2, 2) == ["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1W0 1F1 1I1 1W1"]


@given(schedule_args("zb-h1"))
def test_beats_1f1b_with_its_memory(args: tuple[str, int, int, dict[str, int]]) -> None:
    _, p, m, _ = args
    s = schedules.validate(schedules.get_schedule("zb-h1", p, m))
    assert all(a.op in (Op.F, Op.I, Op.W) for row in s.actions for a in row)
    zb = schedules.simulate(s)
    one = schedules.simulate(schedules.get_schedule("1f1b", p, m))
    assert all(z <= o for z, o in zip(zb.peak_activations, one.peak_activations, strict=True))
    if p > 1:
        assert zb.bubble_fraction < one.bubble_fraction
    if m >= p:
        # Closed form under unit F, I, W: makespan 3m + 2(p - 1) against 1F1B's 3(m + p - 1).
        assert zb.makespan == 3 * m + 2 * (p - 1)
