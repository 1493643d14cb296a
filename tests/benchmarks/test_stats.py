"""benchmarks.stats: summaries, ratios, merged timelines, costs from timelines, predictions."""

from __future__ import annotations

import pytest

from benchmarks.stats import (
    Summary,
    comm_latency,
    idle_not_waiting,
    merge_events,
    paired_ratio,
    predict,
    ratio,
    stage_costs,
    summarize,
)
from schedules import Costs, get_schedule, simulate


def test_summarize_median_min_max() -> None:
    assert summarize([3.0, 1.0, 2.0]) == Summary(2.0, 1.0, 3.0, 3)
    assert summarize([4.0, 1.0, 2.0, 3.0]).median == 2.5
    with pytest.raises(ValueError, match="no measurements"):
        summarize([])


def test_inverse_turns_times_into_rates() -> None:
    rate = summarize([0.5, 1.0, 2.0]).inverse(64)
    assert rate == Summary(64.0, 32.0, 128.0, 3)  # the slowest step is the lowest rate


def test_scaled_keeps_order() -> None:
    assert summarize([1.0, 2.0, 3.0]).scaled(-1) == Summary(-2.0, -3.0, -1.0, 3)


def test_ratio_of_medians_and_missing_sides() -> None:
    assert ratio(summarize([2.0, 4.0, 6.0]), summarize([1.0, 2.0, 3.0])) == 2.0
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 1.0) is None
    assert ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None


def test_paired_ratio_is_the_median_of_round_ratios() -> None:
    # Round 2 is slow for both: pairing cancels it.
    assert paired_ratio([1.0, 5.0, 1.2], [1.0, 5.0, 1.0]) == 1.0
    assert paired_ratio([], []) is None


def test_merge_events_makes_a_measured_timeline_from_every_rank() -> None:
    events = [(1, "1F0", 100.3, 100.4), (0, "0F0", 100.1, 100.2), (0, "0B0", 100.6, 100.8),
              (1, "1B0", 100.4, 100.6)]
    tl = merge_events(2, events, 100.0, {"schedule": "x"})
    assert tl.unit == "s" and tl.num_ranks == 2 and tl.meta == {"schedule": "x"}
    assert [str(e.action) for e in tl.lane(0)] == ["0F0", "0B0"]
    assert tl.makespan == pytest.approx(0.8)
    assert tl.busy(1) == pytest.approx(0.3)


def test_comm_latency_counts_only_waits_on_another_rank() -> None:
    # 1F0 waited for 0F0 (0.05 s gap); 0B0 waited for 1B0 (0.1 s gap); 1F1 did not wait (its
    # rank was busy when 0F1 ended), so its gap is queueing, not transfer.
    events = [(0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 2.0), (1, "1F0", 1.05, 2.5),
              (1, "1F1", 2.6, 3.0), (1, "1B0", 3.0, 4.0), (0, "0B0", 4.1, 5.0),
              (1, "1B1", 4.0, 4.5), (0, "0B1", 5.0, 5.5)]
    tl = merge_events(2, events, 0.0)
    assert comm_latency([tl]) == pytest.approx(0.075)  # median of 0.05 and 0.1
    assert comm_latency([]) == 0.0


def test_stage_costs_recover_a_simulated_schedules_costs() -> None:
    costs = Costs(forward=(1.0, 2.0), backward=(3.0, 4.0), comm=0.5)
    tl = simulate(get_schedule("1f1b", 2, 4), costs)
    got = stage_costs([tl], 2)
    assert got.forward == (1.0, 2.0) and got.backward == (3.0, 4.0)
    assert got.backward_input == (0.0, 0.0)
    assert got.comm == pytest.approx(0.5)


def test_predict_matches_the_simulator_in_seconds() -> None:
    schedule = get_schedule("zb-h1", 2, 4)
    costs = Costs(forward=0.01, backward_input=0.01, backward_weight=0.01)
    planned = predict(schedule, costs)
    assert planned.unit == "s"
    assert planned.makespan == simulate(schedule, costs).makespan


def test_idle_not_waiting_counts_gaps_with_the_input_at_hand() -> None:
    # Rank 0: 0F0 starts 0.2 s late (its input is the batch: overhead), 0F1 follows at once,
    # 0B0 waits for 1B0 (ends 3.0) and starts at 3.1 (0.1 s after it arrived: overhead).
    # Rank 1: 1F0 waits for 0F0 (ends 1.2) and starts at 1.2; 1B0 starts 0.5 s after 1F0
    # although its input is 1F0's own output.
    events = [(0, "0F0", 0.2, 1.2), (0, "0F1", 1.2, 2.2), (0, "0B0", 3.1, 4.0),
              (1, "1F0", 1.2, 2.0), (1, "1B0", 2.5, 3.0)]
    tl = merge_events(2, events, 0.0)
    assert idle_not_waiting(tl) == pytest.approx(0.5)  # rank 1's 0.5 beats rank 0's 0.3
    planned = simulate(get_schedule("1f1b", 3, 6), Costs(comm=0.0))
    assert idle_not_waiting(planned) == 0.0  # the simulator never idles with work ready
