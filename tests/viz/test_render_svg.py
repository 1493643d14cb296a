"""SVG: well-formed XML, one box per action, widths proportional to duration, bubbles shaded."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given

import schedules
from schedules import Costs, Schedule, Timeline
from tests.strategies import schedules_any
from viz import compare, render_svg
from viz.scene import PLOT

NS = {"svg": "http://www.w3.org/2000/svg"}
DATA = Path(__file__).parent / "data"


def _rects(svg: str, cls: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [r for r in root.iter(f"{{{NS['svg']}}}rect") if cls in r.get("class", "").split()]


def _texts(svg: str) -> list[str]:
    return [t.text or "" for t in ET.fromstring(svg).iter(f"{{{NS['svg']}}}text")]


def _proportional(boxes: list[ET.Element], span: float) -> bool:
    """Every box is its duration times the plot's pixels per time unit wide (to SVG's 0.01)."""
    px = PLOT / span
    return all(
        abs(float(b.get("width", 0)) - (float(b.get("data-end", 0)) - float(b.get("data-start", 0)))
            * px) <= 0.006
        for b in boxes if float(b.get("data-end", 0)) > float(b.get("data-start", 0)))


@given(schedules_any())
def test_one_box_per_action_and_widths_follow_costs(schedule: Schedule) -> None:
    costs = Costs(forward=1, backward=2.5, backward_input=1.5, backward_weight=0.5, update=1)
    svg = render_svg(schedule, costs=costs)
    boxes = _rects(svg, "action")
    assert sorted(b.get("data-action", "") for b in boxes) == sorted(
        str(a) for row in schedule.actions for a in row)
    timeline = schedules.simulate(schedule, costs)
    assert _proportional(boxes, timeline.makespan)
    # ... and the durations are the simulator's, under these costs.
    want = {(e.rank, str(e.action)): (e.start, e.end) for e in timeline.events}
    got = {(int(b.get("data-rank", -1)), b.get("data-action")):
           (float(b.get("data-start", -1)), float(b.get("data-end", -1))) for b in boxes}
    assert got == want


def test_boxes_sit_at_their_start_times_and_carry_their_kind() -> None:
    svg = render_svg(schedules.get_schedule("zb-h1", 2, 2))
    boxes = _rects(svg, "action")
    origin = {float(b.get("x", 0)) for b in boxes if float(b.get("data-start", 1)) == 0}
    (x0,) = origin
    xs = {round((float(b.get("x", 0)) - x0) / float(b.get("data-start", 0)), 3)
          for b in boxes if float(b.get("data-start", 0)) > 0}
    assert len(xs) == 1  # x is proportional to the start time
    kinds = {b.get("data-action", "")[1]: b.get("class") for b in boxes}
    assert kinds == {"F": "action op-F", "I": "action op-I", "W": "action op-W"}
    for box in boxes:
        title = box.find("svg:title", NS)
        assert title is not None and box.get("data-action", "") in (title.text or "")


def test_bubbles_are_shaded_and_figures_are_in_the_margin() -> None:
    schedule = schedules.get_schedule("1f1b", 4, 8)
    svg = render_svg(schedule)
    # 1F1B p=4: rank r idles r units before its first forward, (p-1-r) between its warm-up and
    # its first backward... every rank has some gap, and the gaps add up to the bubble.
    timeline = schedules.simulate(schedule)
    bubbles = _rects(svg, "bubble")
    idle = sum(float(b.get("width", 0)) for b in bubbles) / (PLOT / timeline.makespan)
    assert idle == pytest.approx(timeline.bubble_fraction * 4 * timeline.makespan, abs=0.05)
    assert all(b.get("fill") == "url(#hatch)" for b in bubbles)
    texts = _texts(svg)
    assert texts.count("27.3%") == 4  # per-rank bubble, (p-1)/(m+p-1) = 3/11 on every rank
    assert {"4", "3", "2", "1"} <= set(texts)  # peak activations, among the labels
    assert "forward" in texts and "backward" in texts and "idle (bubble)" in texts
    assert texts[0] == "1f1b" and "4 ranks" in texts[1] and "8 micro-batches" in texts[1]


def test_text_is_escaped() -> None:
    s = schedules.get_schedule("gpipe", 2, 1).replace(name='a<b & "c">')
    svg = render_svg(s)
    root = ET.fromstring(svg)
    assert root.findtext("svg:title", namespaces=NS) == 'a<b & "c">'
    assert 'a<b & "c">' in _texts(svg)


def test_invalid_schedule_is_drawn_with_its_failure() -> None:
    svg = render_svg(schedules.load_csv(DATA / "deadlock.csv"))
    marks = _rects(svg, "failure")
    assert len(marks) == 2  # rank 0 and rank 1 wait on each other
    assert all(m.get("stroke") == "#d62728" for m in marks)
    texts = _texts(svg)
    assert any(t.startswith("deadlock:") for t in texts)
    assert any("rank 0 step 0 (0B0) waits for 0F0, 1B0" in t for t in texts)
    assert len(_rects(svg, "action")) == 8


def test_measured_timeline_draws_every_event() -> None:
    timeline = Timeline.from_json((DATA / "measured_1f1b.json").read_text())
    svg = render_svg(timeline)
    boxes = _rects(svg, "action")
    assert len(boxes) == len(timeline.events) == 12
    assert _proportional(boxes, timeline.makespan)
    assert "ms" in _texts(svg)


def test_comparison_shares_the_scale() -> None:
    names = ("gpipe", "1f1b", "interleaved", "zb-h1")
    sources = [schedules.get_schedule(n, 4, 8) for n in names]
    svg = render_svg(compare(sources))
    boxes = _rects(svg, "action")
    assert len(boxes) == sum(len(row) for s in sources for row in s.actions)
    assert _proportional(boxes, 33)  # gpipe and 1f1b: 3 * (8 + 3), the longest
    texts = _texts(svg)
    assert [t for t in texts if t in names] == list(names) * 2  # panel headers, table rows
    assert "28.5" in texts  # interleaved, its 8 stages at half cost each: 3 * 19 / 2
    assert "27 *" in texts  # zb-h1: 3m + p - 1, the best
