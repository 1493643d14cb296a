from hypothesis import given

import schedules
from schedules import Op
from tests.schedules.tables import rows
from tests.strategies import schedule_args


def test_zb_h1_p3_m4_is_the_papers() -> None:
    # Rank r defers r W's; the same order as torch's ScheduleInterleavedZeroBubble at one
    # stage per rank.
    assert rows("zb-h1", 3, 4) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ]


@given(schedule_args("zb-h1"))
def test_zb_h1_makespan_is_the_papers(args: tuple[str, int, int, dict[str, int]]) -> None:
    _, p, m, _ = args
    s = schedules.validate(schedules.get_schedule("zb-h1", p, m))
    assert all(a.op in (Op.F, Op.I, Op.W) for row in s.actions for a in row)
    t = schedules.simulate(s)
    if m >= p:
        # Qi et al.: bubble (p - 1)(F + I - W) = p - 1 at unit costs, so 3m + p - 1 in all.
        assert t.makespan == 3 * m + p - 1
    assert max(t.peak_activations) <= p
