"""Numbers from samples: summaries, ratios, merged timelines, per-stage costs, predictions."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.planner.time_model import message_waits, producer
from schedules import Action, Costs, Event, Op, Schedule, Timeline, simulate

__all__ = [
    "RawEvent",
    "Summary",
    "comm_latency",
    "costs_to_dict",
    "idle_not_waiting",
    "merge_events",
    "paired_ratio",
    "predict",
    "ratio",
    "stage_costs",
    "summarize",
]

# One measured action: (rank, action text such as "1F3", start, end), times absolute (seconds
# on a clock all ranks share: perf_counter is CLOCK_MONOTONIC, system-wide on Linux).
RawEvent = tuple[int, str, float, float]


@dataclass(frozen=True)
class Summary:
    """Median, minimum and maximum of repeated measurements, and how many there were."""

    median: float
    min: float
    max: float
    n: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def scaled(self, factor: float) -> Summary:
        """Every figure times `factor` (which may be negative; min and max stay ordered)."""
        low, high = sorted((self.min * factor, self.max * factor))
        return Summary(self.median * factor, low, high, self.n)

    def inverse(self, numerator: float) -> Summary:
        """`numerator / value` for each figure: a time summary becomes a rate summary."""
        return Summary(numerator / self.median, numerator / self.max, numerator / self.min,
                       self.n)


def summarize(values: Iterable[float]) -> Summary:
    """The median, min and max of `values` (at least one)."""
    data = [float(v) for v in values]
    if not data:
        raise ValueError("cannot summarize no measurements: run at least one repeat")
    return Summary(statistics.median(data), min(data), max(data), len(data))


def ratio(numerator: Summary | float | None, denominator: Summary | float | None
          ) -> float | None:
    """Median over median (None when either side is missing or the denominator is zero)."""
    if numerator is None or denominator is None:
        return None
    a = numerator.median if isinstance(numerator, Summary) else float(numerator)
    b = denominator.median if isinstance(denominator, Summary) else float(denominator)
    return None if b == 0 else a / b


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float | None:
    """Median of per-round ratios: measured in turn, each pair shares the machine's state."""
    pairs = [a / b for a, b in zip(numerators, denominators, strict=False) if b > 0]
    return statistics.median(pairs) if pairs else None


def merge_events(num_ranks: int, events: Iterable[RawEvent], start: float,
                 meta: dict[str, Any] | None = None) -> Timeline:
    """A measured timeline (seconds from `start`) from events recorded on several ranks."""
    out = tuple(Event(r, Action.parse(text), s - start, e - start) for r, text, s, e in events)
    return Timeline(num_ranks, tuple(sorted(out, key=lambda e: (e.start, e.rank))), "s",
                    dict(meta or {}))


def _kind(op: Op) -> str | None:
    return {Op.F: "forward", Op.B: "backward", Op.I: "backward_input",
            Op.W: "backward_weight"}.get(op)


def comm_latency(timelines: Iterable[Timeline]) -> float:
    """Median delay from a producer's end to its consumer's start on another rank, counted only
    where the consumer sat idle waiting for it (so the delay is transfer, not queueing)."""
    gaps = [max(0.0, g) for tl in timelines for g in message_waits(tl)]
    return statistics.median(gaps) if gaps else 0.0


def idle_not_waiting(tl: Timeline) -> float:
    """The most time any rank sat idle although the work it was about to do had its input
    (from its own previous action, or a peer's that had finished): runtime and transfer
    overhead, as opposed to bubbles the schedule makes. Counts from the step's start."""
    index = {(e.action.stage, e.action.op, e.action.microbatch): e for e in tl.events}
    last_stage = max((e.action.stage for e in tl.events), default=0)
    worst = 0.0
    for r in range(tl.num_ranks):
        total, free_at = 0.0, 0.0
        for e in tl.lane(r):
            src = producer(index, e.action, last_stage + 1)
            ready = free_at if src is None or src.rank == r else max(free_at, src.end)
            total += max(0.0, e.start - ready)
            free_at = e.end
        worst = max(worst, total)
    return worst


def stage_costs(timelines: Sequence[Timeline], num_stages: int) -> Costs:
    """Per-stage median duration of F, B, I and W over the timelines, and the comm latency."""
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for tl in timelines:
        for e in tl.events:
            kind = _kind(e.action.op)
            if kind is not None:
                samples[(kind, e.action.stage)].append(e.duration)

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(statistics.median(samples[(kind, s)]) if samples.get((kind, s)) else 0.0
                     for s in range(num_stages))

    return Costs(forward=per_stage("forward"), backward=per_stage("backward"),
                 backward_input=per_stage("backward_input"),
                 backward_weight=per_stage("backward_weight"), comm=comm_latency(timelines))


def predict(schedule: Schedule, costs: Costs) -> Timeline:
    """The simulator's timeline of `schedule` under measured costs (seconds)."""
    planned = simulate(schedule, costs)
    return Timeline(planned.num_ranks, planned.events, "s", dict(planned.meta))


def costs_to_dict(costs: Costs) -> dict[str, Any]:
    """Costs as JSON-ready lists (seconds)."""
    def listed(value: float | Sequence[float]) -> list[float] | float:
        return [float(v) for v in value] if isinstance(value, Sequence) else float(value)

    return {"forward": listed(costs.forward), "backward": listed(costs.backward),
            "backward_input": listed(costs.backward_input),
            "backward_weight": listed(costs.backward_weight), "comm": costs.comm}

