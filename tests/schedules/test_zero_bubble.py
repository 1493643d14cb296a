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


def test_zb_h1_fewer_microbatches_than_ranks() -> None:
    # m < p: warm-ups shorten; rank 1 still holds back one W, rank 2 both of its two.
    assert rows("zb-h1", 3, 2) == [
        "0F0 0F1 0I0 0W0 0I1 0W1",
        "1F0 1F1 1I0 1I1 1W0 1W1",
        "2F0 2I0 2F1 2I1 2W0 2W1",
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


def test_zb_h2_p3_m4() -> None:
    # Rank r warms up with 2(p - r) - 1 forwards; the last rank defers its W's to the end.
    assert rows("zb-h2", 3, 4) == [
        "0F0 0F1 0F2 0F3 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2W0 2W1 2W2 2W3",
    ]


@given(schedule_args("zb-h2"))
def test_zb_h2_has_no_bubble_inside_a_ranks_span(args: tuple[str, int, int, dict[str, int]]
                                                 ) -> None:
    # The paper's parallelogram: rank r computes without a gap from time r to r + 3m.
    _, p, m, _ = args
    t = schedules.simulate(schedules.validate(schedules.get_schedule("zb-h2", p, m)))
    if m >= 2 * p - 1:
        for r in range(p):
            lane = t.lane(r)
            assert (lane[0].start, lane[-1].end) == (r, r + 3 * m)
    assert max(t.peak_activations) <= 2 * p - 1


def test_zb_h1_tight_p3_m4() -> None:
    # 1F1B's per-rank cap min(m, p - r), deferred W's included.
    assert rows("zb-h1-tight", 3, 4) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1W0 1F2 1I1 1W1 1F3 1I2 1W2 1I3 1W3",
        "2F0 2I0 2W0 2F1 2I1 2W1 2F2 2I2 2W2 2F3 2I3 2W3",
    ]


def test_the_memory_bubble_trade() -> None:
    # p=4, m=8 (unit costs): less memory, more bubble, in this order.
    figures = {}
    for name in ("1f1b", "zb-h1-tight", "zb-h1", "zb-h2"):
        t = schedules.simulate(schedules.get_schedule(name, 4, 8))
        figures[name] = (t.makespan, t.peak_activations)
    assert figures == {
        "1f1b": (33, (4, 3, 2, 1)),
        "zb-h1-tight": (30, (4, 3, 2, 1)),
        "zb-h1": (27, (4, 4, 4, 4)),
        "zb-h2": (27, (7, 7, 7, 7)),
    }
    # ZB-H2's longer warm-up hides transfer latency that ZB-H1 waits for.
    late = schedules.Costs(comm=0.5)
    assert {n: schedules.simulate(schedules.get_schedule(n, 4, 8), late).makespan
            for n in ("1f1b", "zb-h1", "zb-h2")} == {"1f1b": 41, "zb-h1": 33, "zb-h2": 28.5}
