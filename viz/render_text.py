"""The rank x time grid for a terminal: plain ASCII, or with ANSI colours, fitted to a width."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from schedules import Costs, Schedule, Timeline
from viz.compare import Comparison
from viz.layout import (
    KIND_NAMES,
    KINDS,
    Box,
    Lane,
    Layout,
    format_number,
    layout,
    nice_ticks,
    time_scale,
)

__all__ = ["render_text"]

# A box is its label (op letter and micro-batch) then a fill that says the op at any width:
# forwards point down the pipeline, backwards back up it.
_FILL = {"F": ">", "B": "<", "I": "<", "W": "=", "U": "#", "comm": "~", "sync": "*"}
_IDLE = "."
_MARK = "!"
# ANSI SGR codes: a background per kind (the same hues as the SVG), black or white text.
_STYLE = {
    "F": "44;97", "B": "42;30", "I": "46;30", "W": "45;97", "U": "47;30", "comm": "43;30",
    "sync": "100;97", "mark": "41;97;1", "idle": "2",
}
_SHORT_UNITS = {"cost units": "cost", "steps": "step"}
_MAX_COLUMNS_PER_BOX = 8  # a median box wider than this only spreads the picture out


def render_text(source: Timeline | Schedule | Layout | Comparison, *, costs: Costs | None = None,
                width: int = 100, color: bool = False) -> str:
    """Draw a timeline, a schedule (simulated under `costs`) or a comparison in `width` columns.

    Time runs left to right, scaled by cost (a B of cost 2 is twice as wide as an F of cost 1);
    under the grid come the time axis, a legend, and the bubble and peak activations per rank.
    Without `color` the result is plain ASCII; with it, ANSI colours on the same characters.
    """
    if isinstance(source, Comparison):
        return _render_comparison(source, width, color)
    lay = layout(source, costs=costs)
    grid = _Grid([lay], lay.span, width)
    lines = [*_wrap(lay.title, width), *_wrap(lay.subtitle, width), ""]
    lines += [grid.lane(lane, lay, color) for lane in lay.lanes]
    lines += grid.axis(lay.unit)
    lines += ["", *_legend(_drawn_kinds([lay]), lay.stages_per_rank > 1,
                           lay.failure is not None, color, width)]
    lines += _summary(lay)
    lines += _failure(lay, width)
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _render_comparison(comparison: Comparison, width: int, color: bool) -> str:
    layouts = comparison.layouts
    grid = _Grid(layouts, comparison.span, width)
    lines = [*_wrap(comparison.title, width), *_wrap(comparison.subtitle, width)]
    for lay in layouts:
        lines += ["", *_wrap(f"{lay.title}: {lay.subtitle}", width)]
        lines += [grid.lane(lane, lay, color) for lane in lay.lanes]
    lines += grid.axis(comparison.unit)
    kinds = _drawn_kinds(layouts)
    chunks = any(lay.stages_per_rank > 1 for lay in layouts)
    failed = any(lay.failure for lay in layouts)
    lines += ["", *_legend(kinds, chunks, failed, color, width), ""]
    lines += _table(comparison.table())
    if comparison.ranked:
        lines.append("* best of the compared schedules")
    for lay in layouts:
        lines += [line.replace("INVALID", f"INVALID {lay.title}", 1)
                  for line in _failure(lay, width)]
    return "\n".join(line.rstrip() for line in lines) + "\n"


class _Grid:
    """Columns per time unit, shared by every lane and the axis of one picture."""

    def __init__(self, layouts: Sequence[Layout], span: float, width: int) -> None:
        self.label = max(len(f"rank {lay.num_ranks - 1}") for lay in layouts) + 1
        columns = max(10, width - self.label - 2)  # 2: the lane's borders
        self.span = span
        scale = columns / span if span > 0 else 1.0
        median = min(lay.median_duration for lay in layouts)
        scale = min(scale, _MAX_COLUMNS_PER_BOX / median)
        if layouts[0].unit != "s" and scale >= 1:
            # Whole columns per cost unit: integer costs then land on column boundaries and
            # equal costs get equal widths.
            scale = math.floor(scale)
        self.scale = scale
        self.columns = self.col(span)

    def col(self, t: float) -> int:
        return math.floor(t * self.scale + 0.5)

    def lane(self, lane: Lane, lay: Layout, color: bool) -> str:
        end = self.col(lay.makespan)
        cells: list[tuple[str, str]] = [(_IDLE, "idle")] * end
        short: list[Box] = []
        for box in lane.boxes:
            c0, c1 = self.col(box.start), self.col(box.end)
            if box.kind == "sync":
                # Syncs never hide work: a background reduction runs beside the compute.
                _paint_idle(cells, c0, _box_text(box, c1 - c0, marked=False) if c1 > c0
                            else _FILL["sync"])  # an instant one: its mark alone
            elif c1 > c0:
                _paint(cells, c0, _box_text(box, c1 - c0, marked=False), box.kind)
            else:
                short.append(box)
        for box in short:  # too short for a column of its own: shown only where the rank idles
            c0 = self.col(box.start)
            if box.kind != "comm" and c0 < len(cells) and cells[c0][1] == "idle":
                cells[c0] = (_box_text(box, 1, marked=False), box.kind)
        for mark in lay.failure.marks if lay.failure else ():
            if mark.rank != lane.rank:
                continue
            c0 = self.col(mark.start)
            c1 = max(c0 + 1, self.col(mark.end))
            boxes = lane.boxes
            text = (_box_text(boxes[mark.step], c1 - c0, marked=True) if mark.step < len(boxes)
                    else _MARK * (c1 - c0))
            _paint(cells, c0, text, "mark")
        body = "".join(_styled(cells, color))
        return f"rank {lane.rank}".ljust(self.label) + "|" + body + "|"

    def axis(self, unit: str) -> list[str]:
        factor, suffix = time_scale(unit, self.span)
        ruler = ["-"] * (self.columns + 1)
        numbers = [" "] * (self.columns + 1)
        free = 0
        for tick in nice_ticks(self.span * factor, max(2, self.columns // 10),
                               whole=unit == "step"):
            c = self.col(tick / factor)
            if c < len(ruler):
                ruler[c] = "+"
            text = format_number(tick)
            if c >= free and c + len(text) <= len(numbers):
                numbers[c:c + len(text)] = text
                free = c + len(text) + 1
        # The unit goes left of the numbers, under the rank labels, where there is room.
        unit_label = _SHORT_UNITS.get(suffix, suffix)[:self.label].rjust(self.label) + " "
        return [" " * (self.label + 1) + "".join(ruler), unit_label + "".join(numbers)]


def _paint_idle(cells: list[tuple[str, str]], c0: int, text: str) -> None:
    """`text` as a sync box, in the cells from `c0` that are idle."""
    for k, ch in enumerate(text):
        if c0 + k < len(cells) and cells[c0 + k][1] == "idle":
            cells[c0 + k] = (ch, "sync")


def _box_text(box: Box, width: int, *, marked: bool) -> str:
    label = box.label
    if box.chunk % 2:  # odd virtual stages in lower case, so interleaved stages tell apart
        label = label[0].lower() + label[1:]
    if len(label) > width:
        label = label[0]  # a cut micro-batch number would be a wrong one
    fill = _MARK if marked else _FILL[box.kind]
    return (label + fill * width)[:width]


def _paint(cells: list[tuple[str, str]], start: int, text: str, style: str) -> None:
    if start + len(text) > len(cells):
        cells.extend([(" ", "idle")] * (start + len(text) - len(cells)))
    for i, ch in enumerate(text):
        cells[start + i] = (ch, style)


def _styled(cells: list[tuple[str, str]], color: bool) -> list[str]:
    if not color:
        return [ch for ch, _ in cells]
    out, i = [], 0
    while i < len(cells):
        j = i
        while j < len(cells) and cells[j][1] == cells[i][1]:
            j += 1
        text = "".join(ch for ch, _ in cells[i:j])
        out.append(f"\x1b[{_STYLE[cells[i][1]]}m{text}\x1b[0m")
        i = j
    return out


def _drawn_kinds(layouts: Sequence[Layout]) -> tuple[str, ...]:
    """Kinds with a box that takes time: instant sends and receives leave no mark in text."""
    present = {b.kind for lay in layouts for lane in lay.lanes for b in lane.boxes
               if b.end > b.start or b.kind == "sync"}
    return tuple(k for k in KINDS if k in present)


def _legend(kinds: Sequence[str], chunks: bool, failed: bool, color: bool,
            width: int) -> list[str]:
    items: list[tuple[str, str]] = []  # (plain, as printed): wrapped by the plain length
    for kind in kinds:
        chip = {"comm": "S/R", "sync": "Ta"}.get(kind, kind) + _FILL[kind]
        name = KIND_NAMES[kind]
        items.append((f"{chip} {name}",
                      "".join(_styled([(ch, kind) for ch in chip], color)) + f" {name}"))
    items.append((f"{_IDLE} idle", "".join(_styled([(_IDLE, "idle")], color)) + " idle"))
    if failed:
        items.append((f"{_MARK} failing step",
                      "".join(_styled([(_MARK, "mark")], color)) + " failing step"))
    items.append(("(box: op, micro-batch, fill)",) * 2)
    if chunks:
        items.append(("lower case: a rank's 2nd, 4th.. stage",) * 2)
    lines, plain, printed = [], "", ""
    for text, shown in items:
        if plain and len(plain) + 2 + len(text) > width:
            lines.append(printed)
            plain, printed = "", ""
        plain += ("  " if plain else "") + text
        printed += ("  " if printed else "") + shown
    return [*lines, printed]


def _summary(lay: Layout) -> list[str]:
    if lay.bubble is None:
        return [f"peak activations per rank: {' '.join(str(ln.peak) for ln in lay.lanes)}"]
    factor, suffix = time_scale(lay.unit, lay.makespan)
    width = len(f"rank {lay.num_ranks - 1}")
    lines = [f"makespan {format_number(lay.makespan * factor)} {suffix}, "
             f"bubble {lay.bubble:.1%} of rank-time", ""]
    lines.append(" " * width + "  bubble  peak activations")
    for ln in lay.lanes:
        bubble = f"{ln.bubble:.1%}" if ln.bubble is not None else "-"
        lines.append(f"rank {ln.rank}".ljust(width) + f"  {bubble:>6}  {ln.peak}")
    return lines


def _failure(lay: Layout, width: int) -> list[str]:
    if lay.failure is None:
        return []
    where = ", ".join(f"rank {m.rank} step {m.step}" for m in lay.failure.marks)
    lines = ["", *_wrap("INVALID: " + (f"failing step marked {_MARK} ({where})" if where
                                       else "no single step to mark"), width)]
    for line in lay.failure.message.splitlines():
        indent = "  " + " " * (len(line) - len(line.lstrip()))
        lines += _wrap(line.strip(), width, indent=indent)
    return lines


def _wrap(text: str, width: int, *, indent: str = "") -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False) or [""]


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) if i < 2 else c.ljust(w)
                                             for i, (c, w) in enumerate(zip(row[1:], widths[1:],
                                                                            strict=True))]
        out.append("  ".join(cells))
    return out
