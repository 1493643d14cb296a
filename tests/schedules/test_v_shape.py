import itertools

from hypothesis import given

import schedules
from schedules import Op
from tests.schedules.tables import rows
from tests.strategies import schedule_args


def test_zb_v_p2_m4_is_torchs() -> None:
    # torch 2.13's ScheduleZBVZeroBubble, idle cells removed. Rank 0: stages 0 and 3.
    assert rows("zb-v", 2, 4) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
        "0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
        "1I3 1W2 2W3 1W3",
    ]


def test_zb_v_fewer_microbatches_drops_the_missing_ones() -> None:
    # Built for 2p - 1 = 3 micro-batches; those of micro-batches 1 and 2 are left out.
    assert rows("zb-v", 2, 1) == ["0F0 3F0 3I0 3W0 0I0 0W0", "1F0 2F0 2I0 2W0 1I0 1W0"]


def test_dualpipe_v_p2_m4_is_torchs() -> None:
    # torch 2.13's ScheduleDualPipeV, each OVERLAP_F_B written as its F then its B.
    assert rows("dualpipe-v", 2, 4) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]


def test_dualpipe_v_below_2p_microbatches() -> None:
    # torch refuses m < 2p; the order for 2p micro-batches without the missing ones is valid.
    assert rows("dualpipe-v", 2, 3) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3B1 3F2 0B0 3B2 0B1 0I2 0W2",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 2B1 1B1 2B2 1B2",
    ]
    assert rows("dualpipe-v", 2, 1) == ["0F0 3F0 3I0 3W0 0B0", "1F0 2F0 2B0 1B0"]


@given(schedule_args("zb-v"))
def test_zb_v_places_stages_in_a_v(args: tuple[str, int, int, dict[str, int]]) -> None:
    _, p, m, _ = args
    s = schedules.validate(schedules.get_schedule("zb-v", p, m))
    assert (s.placement, s.num_stages) == ("v", 2 * p)
    for r in range(p):
        assert {a.stage for a in s.actions[r]} == {r, 2 * p - 1 - r}
    # 1F1B's peak in whole-rank shares: two half-size stages per rank, at most 2p halves.
    assert max(schedules.simulate(s).peak_activations) <= 2 * p


@given(schedule_args("dualpipe-v"))
def test_dualpipe_v_overlaps_a_forward_with_a_backward(
        args: tuple[str, int, int, dict[str, int]]) -> None:
    _, p, m, _ = args
    s = schedules.validate(schedules.get_schedule("dualpipe-v", p, m))
    assert s.placement == "v"
    if m < 2 * p:
        return
    for r, row in enumerate(s.actions):
        pairs = sum(a.op is Op.F and b.op is Op.B and a.stage != b.stage
                    for a, b in itertools.pairwise(row))
        # Two pairs per main-phase round, one per round of the phase after it.
        assert pairs == 2 * (m - 2 * p + r + 1) + (p - r - 1), r
