"""Pixel geometry of a timeline picture (rectangles, text, lines), shared by SVG and PNG."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from viz.compare import Comparison
from viz.layout import KIND_NAMES, Layout, format_number, nice_ticks, time_scale

__all__ = ["COLORS", "Line", "Rect", "Scene", "Text", "build_scene", "text_width"]

# Light hues (Okabe-Ito inspired, distinguishable with common colour blindness) under dark text.
COLORS = {
    "F": "#7db9ee", "B": "#62c59a", "I": "#4fc0c8", "W": "#b79be6", "U": "#a0a0a0",
    "comm": "#f0d35a", "sync": "#e69f00",
}
MARK_COLOR = "#d62728"
IDLE_COLOR = "#f1f1f1"
INK = "#222222"
MUTED = "#666666"

WIDTH = 1000
LEFT = 70  # rank labels to the left of the plot
PLOT = 700  # the time axis
RIGHT = LEFT + PLOT + 18  # per-rank bubble and peak activations
LANE = 24
LANE_GAP = 6


@dataclass(frozen=True, slots=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str | None = None
    stroke_width: float = 0.0
    hatch: bool = False  # an idle stretch: light fill with diagonal lines
    cls: str = ""
    tooltip: str = ""
    data: tuple[tuple[str, str], ...] = ()  # machine-readable facts (SVG data-* attributes)


@dataclass(frozen=True, slots=True)
class Text:
    x: float
    y: float  # baseline
    text: str
    size: float = 11
    anchor: str = "start"  # "start", "middle" or "end", as in SVG
    bold: bool = False
    fill: str = INK
    mono: bool = False


@dataclass(frozen=True, slots=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str = MUTED
    width: float = 1.0


Item = Rect | Text | Line


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    title: str
    items: tuple[Item, ...]


def text_width(text: str, size: float, *, bold: bool = False) -> float:
    """A sans-serif text's width, estimated: no font metrics are at hand when writing SVG."""
    return len(text) * size * (0.62 if bold else 0.56)


def darken(color: str, amount: float) -> str:
    """`color` mixed with black: a rank's later virtual stages get darker shades of a hue."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c * (1 - amount)):02x}" for c in (r, g, b))


def build_scene(source: Layout | Comparison) -> Scene:
    """Lay out the picture: title, lanes (stacked panels for a comparison), axis, legend."""
    panels = source.layouts if isinstance(source, Comparison) else (source,)
    span = source.span
    scale = PLOT / span if span > 0 else 1.0
    items: list[Item] = []
    items.append(Text(16, 28, source.title, 17, bold=True))
    items.append(Text(16, 48, source.subtitle, 12, fill=MUTED))
    y = 72.0
    grid_top = y
    compared = isinstance(source, Comparison)
    panel_items: list[Item] = []
    for lay in panels:
        if compared:
            y += 20
            panel_items.append(Text(16, y, lay.title, 13, bold=True))
            panel_items.append(Text(24 + text_width(lay.title, 13, bold=True), y, lay.subtitle,
                                    11, fill=MUTED))
            y += 10
        y = _panel(panel_items, lay, y, scale)
    # Grid lines first, so every box is drawn over them.
    unit = source.unit
    factor, suffix = time_scale(unit, span)
    ticks = nice_ticks(span * factor, 10, whole=unit == "step")
    for tick in ticks:
        x = LEFT + tick / factor * scale
        items.append(Line(x, grid_top, x, y + 4, "#e4e4e4"))
    items += panel_items
    items.append(Line(LEFT, y + 4, LEFT + span * scale, y + 4, MUTED))
    for tick in ticks:
        x = LEFT + tick / factor * scale
        items.append(Line(x, y + 4, x, y + 9, MUTED))
        items.append(Text(x, y + 22, format_number(tick), 10, anchor="middle", fill=MUTED))
    items.append(Text(LEFT + PLOT + 14, y + 22, suffix, 10, fill=MUTED))
    y += 44
    if compared:
        assert isinstance(source, Comparison)
        y = _table(items, source.table(), y)
    else:
        lay = panels[0]
        if lay.bubble is not None:
            fac, suf = time_scale(lay.unit, lay.makespan)
            items.append(Text(16, y, f"makespan {format_number(lay.makespan * fac)} {suf}, "
                              f"bubble {lay.bubble:.1%} of rank-time", 12))
            y += 24
    y = _legend(items, panels, y)
    for lay in panels:
        if lay.failure is not None:
            y = _failure(items, lay, y + 6, compared)
    return Scene(WIDTH, int(y + 12), source.title, tuple(items))


def _panel(items: list[Item], lay: Layout, y: float, scale: float) -> float:
    items.append(Text(RIGHT, y - 6, "bubble", 10, fill=MUTED))
    items.append(Text(RIGHT + 64, y - 6, "peak activations", 10, fill=MUTED))
    for lane in lay.lanes:
        items.append(Text(LEFT - 10, y + LANE / 2 + 4, f"rank {lane.rank}", 12, anchor="end"))
        for start, end in lane.gaps:
            items.append(Rect(LEFT + start * scale, y, (end - start) * scale, LANE, IDLE_COLOR,
                              hatch=True, cls="bubble"))
        for box in lane.boxes:
            fill = COLORS[box.kind]
            if box.chunk:
                fill = darken(fill, min(0.45, 0.22 * box.chunk))
            width = (box.end - box.start) * scale
            x = LEFT + box.start * scale
            a = box.action
            times = f"{format_number(box.start)}-{format_number(box.end)}"
            # A sync is a strip along the lane's foot: a background reduction runs beside the
            # compute above it, and an instant one still shows.
            top, height = (y + LANE * 0.7, LANE * 0.3) if box.kind == "sync" else (y, LANE)
            items.append(Rect(
                x, top, width if width > 3 else 3.0 if box.kind == "sync" else 1.5 if width <= 0
                else width, height, fill, "#ffffff", 0.75,
                cls=f"action op-{box.kind}",
                tooltip=f"rank {lane.rank} step {box.step}: {a} ({KIND_NAMES[box.kind]}, stage "
                        f"{a.stage}, micro-batch {a.microbatch}) {times}",
                data=(("rank", str(lane.rank)), ("action", str(a)),
                      ("start", repr(box.start)), ("end", repr(box.end)))))
            label = str(a.microbatch)
            if box.kind != "sync" and text_width(label, 11) + 4 <= width:
                items.append(Text(x + width / 2, y + LANE / 2 + 4, label, 11, anchor="middle"))
        for mark in lay.failure.marks if lay.failure else ():
            if mark.rank == lane.rank:
                items.append(Rect(LEFT + mark.start * scale, y - 1,
                                  max(4.0, (mark.end - mark.start) * scale), LANE + 2, "none",
                                  MARK_COLOR, 3, cls="failure"))
        bubble = f"{lane.bubble:.1%}" if lane.bubble is not None else "-"
        items.append(Text(RIGHT, y + LANE / 2 + 4, bubble, 12))
        items.append(Text(RIGHT + 64, y + LANE / 2 + 4, str(lane.peak), 12))
        y += LANE + LANE_GAP
    return y


def _table(items: list[Item], rows: Sequence[Sequence[str]], y: float) -> float:
    widths = [max(text_width(row[i], 12, bold=True) for row in rows) for i in range(len(rows[0]))]
    xs, x = [], 16.0
    for w in widths:
        xs.append(x)
        x += w + 28
    for n, row in enumerate(rows):
        if n % 2 == 0 and n:
            items.append(Rect(10, y - 15, x - 10, 21, "#f6f6f6"))
        for i, cell in enumerate(row):
            items.append(Text(xs[i], y, cell, 12, bold=n == 0 or cell.endswith("*")))
        y += 21
    if any(cell.endswith("*") for row in rows for cell in row):
        items.append(Text(16, y, "* best of the compared schedules", 10, fill=MUTED))
    return y + 26


def _legend(items: list[Item], panels: Sequence[Layout], y: float) -> float:
    kinds = tuple(dict.fromkeys(k for lay in panels for k in lay.kinds))
    entries: list[tuple[Rect, str]] = [
        (Rect(0, 0, 12, 12, COLORS[k]), KIND_NAMES[k]) for k in kinds]
    entries.append((Rect(0, 0, 12, 12, IDLE_COLOR, "#bbbbbb", 0.5, hatch=True), "idle (bubble)"))
    if any(lay.failure for lay in panels):
        entries.append((Rect(0, 0, 12, 12, "none", MARK_COLOR, 2.5), "failing step"))
    if any(lay.stages_per_rank > 1 for lay in panels):
        entries.append((Rect(0, 0, 12, 12, darken(COLORS["F"], 0.22)),
                        "darker: a rank's later stage"))
    x = 16.0
    for chip, name in entries:
        items.append(Rect(x, y - 10, chip.w, chip.h, chip.fill, chip.stroke, chip.stroke_width,
                          chip.hatch))
        items.append(Text(x + 17, y, name, 12))
        x += 17 + text_width(name, 12) + 18
    return y + 20


def _failure(items: list[Item], lay: Layout, y: float, compared: bool) -> float:
    assert lay.failure is not None
    head = "invalid schedule" + (f" {lay.title}" if compared else "")
    where = ", ".join(f"rank {m.rank} step {m.step}" for m in lay.failure.marks)
    items.append(Text(16, y + 4, head + (f": failing step marked ({where})" if where else ""),
                      12, bold=True, fill=MARK_COLOR))
    y += 22
    for line in lay.failure.message.splitlines():
        items.append(Text(16, y, line, 11, fill=MARK_COLOR, mono=True))
        y += 15
    return y
