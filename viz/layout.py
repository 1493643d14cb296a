"""What to draw, as data: lanes of boxes and idle gaps, per-rank figures and a failure, if any."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from schedules import (
    SYNC_LABELS,
    Action,
    Costs,
    Event,
    Op,
    Schedule,
    ScheduleError,
    Timeline,
    simulate,
    validate,
)

__all__ = [
    "KINDS",
    "KIND_NAMES",
    "Box",
    "Failure",
    "Lane",
    "Layout",
    "Mark",
    "format_costs",
    "format_number",
    "kind_of",
    "layout",
    "nice_ticks",
    "time_scale",
]

# Legend order; "comm" covers all four SEND/RECV ops, which draw alike, and "sync" a program's
# synchronisations (tied weights, dp reductions, the scaler's agreement: schedules.program).
KINDS = ("F", "B", "I", "W", "U", "comm", "sync")
KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "input grad",
    "W": "weight grad",
    "U": "update",
    "comm": "send/recv",
    "sync": "sync (ties, dp, scaler)",
}


def kind_of(op: Op) -> str:
    """The drawing kind of an op: its letter for compute ops, "comm" for SEND/RECV, "sync" for
    a program's synchronisations."""
    if op.value in KIND_NAMES:
        return op.value
    return "sync" if op.value in SYNC_LABELS else "comm"


@dataclass(frozen=True, slots=True)
class Box:
    """One action on its lane; times are relative to the layout's origin."""

    rank: int
    step: int  # position in the rank's list (its order of start)
    action: Action
    start: float
    end: float
    chunk: int  # which of the rank's stages, 0 for the lowest: shades interleaved stages apart

    @property
    def kind(self) -> str:
        return kind_of(self.action.op)

    @property
    def label(self) -> str:
        """Op letter and micro-batch (batch, for U), e.g. `F3`; `S`/`R` for sends/receives; a
        sync's two letters and the stage it concerns (`Ts0`: take stage 0's tied weights)."""
        op = self.action.op
        if self.kind == "sync":
            return SYNC_LABELS[op.value] + _sync_stage(self.action)
        letter = op.value if self.kind != "comm" else op.value[0]
        return f"{letter}{self.action.microbatch}"


def _sync_stage(action: Action) -> str:
    """The stage a sync box names: the peer of a tie action, the stage of a reduction."""
    if action.op is Op.REDUCE_GRAD:
        return str(action.stage)
    if action.op in (Op.AWAIT_GRAD, Op.OVERFLOW):
        return ""
    return str(action.microbatch)


@dataclass(frozen=True, slots=True)
class Lane:
    rank: int
    boxes: tuple[Box, ...]
    gaps: tuple[tuple[float, float], ...]  # idle intervals (no compute) within the makespan
    bubble: float | None  # idle fraction of the makespan; None when the times are not real
    peak: int  # peak in-flight activations (micro-batches forwarded, not yet backwarded)


@dataclass(frozen=True, slots=True)
class Mark:
    """A step the validator flagged; `step` may be one past the end (the rank stopped there)."""

    rank: int
    step: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Failure:
    message: str  # the validator's message, without its grid (the drawing is the grid)
    marks: tuple[Mark, ...]


@dataclass(frozen=True)
class Layout:
    """A timeline ready to draw: one lane per rank, on a time axis starting at 0."""

    title: str
    subtitle: str
    unit: str  # "cost" (planned), "s" (measured) or "step" (untimed: the schedule cannot run)
    makespan: float
    lanes: tuple[Lane, ...]
    bubble: float | None
    stages_per_rank: int
    failure: Failure | None = None
    # What was laid out (simulated, measured, or one box per step), for Chrome trace and JSON.
    timeline: Timeline | None = field(default=None, compare=False, repr=False)

    @property
    def num_ranks(self) -> int:
        return len(self.lanes)

    @property
    def span(self) -> float:
        """The time the drawing covers: the makespan, or past it to show a marked end."""
        marks = self.failure.marks if self.failure else ()
        return max([self.makespan, *(m.end for m in marks)])

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of box present, in legend order."""
        present = {b.kind for lane in self.lanes for b in lane.boxes}
        return tuple(k for k in KINDS if k in present)

    @property
    def median_duration(self) -> float:
        """Median length of a compute box: how fine the drawing needs to be."""
        durations = sorted(b.end - b.start for lane in self.lanes for b in lane.boxes
                           if b.kind not in ("comm", "sync") and b.end > b.start)
        return durations[len(durations) // 2] if durations else 1.0


def format_number(value: float) -> str:
    """Up to three decimals, no trailing zeros: 33, 2.5, 0.125."""
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def format_costs(costs: Costs, ops: Sequence[str] = ("F", "B", "I", "W", "U")) -> str:
    """`F=1 B=2 comm=0.1` for the given op letters (a per-stage cost shows as `1/1/2`)."""
    names = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight",
             "U": "update"}
    parts = []
    for op in ops:
        value = getattr(costs, names[op])
        values = value if isinstance(value, tuple) else (value,)
        parts.append(f"{op}=" + "/".join(format_number(v) for v in values))
    parts.append(f"comm={format_number(costs.comm)}")
    for name, field_name in (("tie", "tie"), ("REDUCE_GRAD", "reduce_grad"),
                             ("OVERFLOW", "overflow")):  # a program's syncs, where they cost
        value = getattr(costs, field_name)
        values = value if isinstance(value, tuple) else (value,)
        if any(values):
            parts.append(f"{name}=" + "/".join(format_number(v) for v in values))
    if costs.microbatch:  # micro-batches of unequal cost (token micro-batches)
        parts.append("mb=" + "/".join(format_number(v) for v in costs.microbatch))
    return " ".join(parts)


def time_scale(unit: str, span: float) -> tuple[float, str]:
    """(factor, suffix) to show times: measured seconds become ms or us when short."""
    if unit != "s":
        return 1.0, "steps" if unit == "step" else "cost units"
    if span >= 1:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def nice_ticks(span: float, max_ticks: int, *, whole: bool = False) -> list[float]:
    """Tick positions 0, d, 2d, ... <= span, with d a 1, 2 or 5 times a power of ten.

    `whole`: no step below 1 (steps of a schedule that cannot run have no halves).
    """
    if span <= 0 or max_ticks < 1:
        return [0.0]
    raw = max(span / max_ticks, 1.0) if whole else span / max_ticks
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def layout(source: Timeline | Schedule | Layout, *, costs: Costs | None = None,
           title: str | None = None) -> Layout:
    """Lay out a measured or simulated timeline, or a schedule (validated, then simulated).

    A schedule that fails `validate` still gets a layout, with the failing step marked; if it
    cannot even be simulated (a deadlock, a missing action), one step per time unit.
    """
    if isinstance(source, Layout):
        return source
    if isinstance(source, Timeline):
        return _from_timeline(source, title=title)
    return _from_schedule(source, costs or Costs(), title=title)


def _from_schedule(schedule: Schedule, costs: Costs, *, title: str | None) -> Layout:
    problem: tuple[str, dict[int, int]] | None = None
    try:
        validate(schedule)
    except ScheduleError as exc:
        problem = (exc.reason, exc.marks)
    try:
        timeline = simulate(schedule, costs)
    except ScheduleError:
        # Deadlocked or incomplete: no times exist, so draw the lists as they are, step by step.
        timeline = Timeline(schedule.num_ranks, tuple(
            Event(r, a, float(i), float(i + 1))
            for r, row in enumerate(schedule.actions) for i, a in enumerate(row)), "step")
    ops = sorted({a.op.value for row in schedule.actions for a in row if a.is_compute},
                 key="FBIWU".index)
    batches = f" x {schedule.num_batches} batches" if schedule.num_batches > 1 else ""
    if schedule.syncs is not None and not schedule.syncs.empty:
        batches += f"; syncs {schedule.syncs}"
    what = "planned" if timeline.unit == "cost" else "cannot run: one box per step"
    subtitle = (f"{schedule.num_ranks} ranks, {schedule.num_stages} stages "
                f"({schedule.placement}), {schedule.num_microbatches} micro-batches{batches}; "
                f"costs {format_costs(costs, ops)}; {what}")
    result = _from_timeline(timeline, title=title or schedule.name, subtitle=subtitle,
                            stages_per_rank=schedule.stages_per_rank)
    if problem is None:
        return result
    message, marks = problem
    return _with_failure(result, message, marks)


def _from_timeline(timeline: Timeline, *, title: str | None, subtitle: str | None = None,
                   stages_per_rank: int | None = None) -> Layout:
    meta = timeline.meta
    origin = min([0.0, *(e.start for e in timeline.events)])  # as Timeline.makespan counts
    timed = timeline.unit != "step"
    bubbles, peaks = timeline.rank_bubble, timeline.peak_activations
    lanes = []
    for r in range(timeline.num_ranks):
        events = timeline.lane(r)
        stages = sorted({e.action.stage for e in events})
        boxes = tuple(Box(r, i, e.action, e.start - origin, e.end - origin,
                          stages.index(e.action.stage)) for i, e in enumerate(events))
        lanes.append(Lane(r, boxes, _gaps(boxes, timeline.makespan),
                          bubbles[r] if timed else None, peaks[r]))
    if stages_per_rank is None:
        stages_per_rank = max([1, *(len({b.action.stage for b in lane.boxes}) for lane in lanes)])
    if subtitle is None:
        subtitle = _describe(timeline)
    return Layout(
        title=title or str(meta.get("schedule", "timeline")),
        subtitle=subtitle,
        unit=timeline.unit,
        makespan=timeline.makespan,
        lanes=tuple(lanes),
        bubble=timeline.bubble_fraction if timed else None,
        stages_per_rank=stages_per_rank,
        timeline=timeline,
    )


def _describe(timeline: Timeline) -> str:
    meta = timeline.meta
    parts = [f"{timeline.num_ranks} ranks"]
    for key, what in (("num_stages", "stages"), ("num_microbatches", "micro-batches"),
                      ("num_batches", "batches")):
        if key in meta and not (key == "num_batches" and meta[key] == 1):
            parts.append(f"{meta[key]} {what}")
    text = ", ".join(parts)
    if "costs" in meta:
        text += f"; costs {meta['costs']}"
    if meta.get("predicted"):  # seconds, but simulated (pipeline.plan's timelines)
        return text + "; predicted"
    return text + ("; measured" if timeline.unit == "s" else "; planned")


def _gaps(boxes: Sequence[Box], makespan: float) -> tuple[tuple[float, float], ...]:
    """Stretches of [0, makespan] with no compute box: the rank's bubbles."""
    gaps, cursor = [], 0.0
    for b in sorted((b for b in boxes if b.kind not in ("comm", "sync")),
                    key=lambda b: b.start):
        if b.start > cursor:
            gaps.append((cursor, b.start))
        cursor = max(cursor, b.end)
    if cursor < makespan:
        gaps.append((cursor, makespan))
    return tuple(gaps)


def _with_failure(base: Layout, message: str, marks: dict[int, int]) -> Layout:
    found = []
    for rank, step in sorted(marks.items()):
        if not 0 <= rank < base.num_ranks:
            continue
        boxes = base.lanes[rank].boxes
        if step < len(boxes):
            found.append(Mark(rank, step, boxes[step].start, boxes[step].end))
        else:  # the rank stopped before this step: mark a slot after its last box
            start = boxes[-1].end if boxes else 0.0
            found.append(Mark(rank, step, start, start + base.median_duration))
    return replace(base, failure=Failure(message, tuple(found)))
