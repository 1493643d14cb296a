import pytest
from hypothesis import given

import schedules
from tests.schedules.tables import rows
from tests.strategies import schedule_args


def test_p2_m4_v2_matches_megatron_order() -> None:
    # The depth-first order of Megatron-LM and torch's ScheduleInterleaved1F1B, idle cells removed.
    assert rows("interleaved", 2, 4, stages_per_rank=2) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_p2_m2_v2() -> None:
    assert rows("interleaved", 2, 2, stages_per_rank=2) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1",
    ]


def test_p3_m4_v2_one_round() -> None:
    # m // p = 1 round of 4: all four micro-batches go through local stage 0 before stage 1.
    assert rows("interleaved", 3, 4, stages_per_rank=2) == [
        "0F0 0F1 0F2 0F3 3F0 3F1 3F2 3F3 3B0 3B1 3B2 3B3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 4F0 4F1 4F2 4B0 4F3 4B1 4B2 4B3 1B0 1B1 1B2 1B3",
        "2F0 2F1 2F2 2F3 5F0 5B0 5F1 5B1 5F2 5B2 5F3 5B3 2B0 2B1 2B2 2B3",
    ]


def test_needs_two_stages_per_rank() -> None:
    with pytest.raises(schedules.ScheduleError, match="stages_per_rank >= 2"):
        schedules.get_schedule("interleaved", 2, 4, stages_per_rank=1)


@given(schedule_args("interleaved"))
def test_beats_1f1b(args: tuple[str, int, int, dict[str, int]]) -> None:
    _, p, m, options = args
    v = options["stages_per_rank"]
    s = schedules.validate(schedules.get_schedule("interleaved", p, m, **options))
    t = schedules.simulate(s)
    one = schedules.simulate(schedules.get_schedule("1f1b", p, m))
    if m >= p and p > 1:
        assert t.bubble_fraction < one.bubble_fraction
    if m % p == 0:
        # Closed form (per-stage unit costs; each stage is 1/v of the model).
        assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
    assert t.num_ranks == p
