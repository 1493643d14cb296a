"""Comparisons: one time axis, each schedule doing the same work, a table to choose from."""

from __future__ import annotations

import pytest

import schedules
from schedules import Action, Costs, Event, Op, Timeline
from viz import compare


def test_table_reports_makespan_bubble_and_peak_with_the_best_starred() -> None:
    c = compare([schedules.get_schedule(n, 4, 8) for n in ("gpipe", "1f1b", "interleaved",
                                                          "zb-h1")])
    header, *rows = c.table()
    assert header == ("schedule", "makespan (cost units)", "bubble",
                      "peak activations (per rank)")
    assert rows == [
        ("gpipe", "33", "27.3%", "8 (8/8/8/8)"),
        ("1f1b", "33", "27.3%", "4 * (4/3/2/1)"),
        # 8 stages at half the cost each: 19 steps of 1.5, bubble (p-1)/(vm+p-1) = 3/19.
        ("interleaved", "28.5", "15.8%", "11 (11/9/7/5)"),
        # 3m + p - 1 = 27, bubble (p-1)/(3m+p-1) = 3/27; 4 alive on every rank.
        ("zb-h1", "27 *", "11.1% *", "4 * (4/4/4/4)"),
    ]
    assert c.span == 33 and c.unit == "cost"


def test_costs_are_split_over_a_ranks_stages() -> None:
    c = compare([schedules.get_schedule("interleaved", 2, 4, stages_per_rank=4)],
                costs=Costs(forward=2, backward=4, comm=0.5))
    (lay,) = c.layouts
    box = lay.lanes[0].boxes[0]
    assert box.end - box.start == 0.5  # F=2 over 4 stages
    assert "F=0.5 B=1 comm=0.5" in lay.subtitle  # latency is per transfer: unchanged


def test_measured_and_planned_do_not_share_an_axis() -> None:
    measured = Timeline(1, (Event(0, Action(0, Op.F, 0), 0.0, 0.01),), "s")
    with pytest.raises(ValueError, match="cannot compare measured"):
        compare([measured, schedules.get_schedule("gpipe", 1, 1)])
    with pytest.raises(ValueError, match="at least one"):
        compare([])
    assert compare([measured, measured]).unit == "s"
