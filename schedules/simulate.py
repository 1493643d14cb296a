"""The simulator: times a schedule under a cost model, in the timeline format runs record."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, repeat
from operator import attrgetter
from typing import Any

from schedules.compiled import Graph, graph_of, run
from schedules.graph import Deadlock, execute
from schedules.ir import COMPUTE_OPS, Action, Op, Schedule, ScheduleError
from schedules.planned import execute_by_kind

__all__ = ["Costs", "Event", "Timeline", "makespan", "peak_activations", "simulate"]

_FIELDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight",
           "U": "update", "comm": "comm", "tie": "tie", "REDUCE_GRAD": "reduce_grad",
           "OVERFLOW": "overflow"}


@dataclass(frozen=True, slots=True)
class Costs:
    """Duration of each op kind; a float for every stage, or a sequence with one per stage.

    `comm` is the latency added to every dependency that crosses ranks. SEND/RECV actions of a
    lowered schedule take no time themselves: their cost is that latency.

    A program's syncs (schedules.program): `tie` (per copy stage) is the time its tied weights,
    or their gradients, take between ranks, added to the wait for them; `reduce_grad` (per
    stage) is the time of the all-reduce of its gradients over dp, which runs beside the
    rank's work from its REDUCE_GRAD; `overflow` is the scaler's agreement. All default to 0,
    so a program costs what its schedule costs until they are measured.

    `microbatch` scales every compute op of micro-batch m by `microbatch[m]` (repeating for
    later batches): micro-batches of unequal cost, such as token micro-batches trimmed to
    their own longest row. Empty (the default): every micro-batch costs the same.
    """

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    backward_input: float | Sequence[float] = 1.0
    backward_weight: float | Sequence[float] = 1.0
    update: float | Sequence[float] = 0.0
    comm: float = 0.0
    tie: float | Sequence[float] = 0.0
    reduce_grad: float | Sequence[float] = 0.0
    overflow: float = 0.0
    microbatch: Sequence[float] = ()

    def __post_init__(self) -> None:
        scales = tuple(float(v) for v in self.microbatch)
        if any(not v >= 0 for v in scales):
            raise ValueError(f"Costs.microbatch must be >= 0 per micro-batch (got {scales})")
        object.__setattr__(self, "microbatch", scales)
        for name in _FIELDS.values():
            value = getattr(self, name)
            values = [value] if isinstance(value, int | float) else list(value)
            if any(v < 0 for v in values):
                raise ValueError(f"Costs.{name} must be >= 0 (got {value!r})")
            if not isinstance(value, int | float):
                object.__setattr__(self, name, tuple(float(v) for v in values))

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read `"F=1,B=2,I=1,W=1,U=0,comm=0.1"` (any subset; the rest keep their defaults; the
        syncs' are `tie`, `REDUCE_GRAD` and `OVERFLOW`; `mb=4/2/1` scales micro-batches)."""
        kwargs: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if sep and name.strip() == "mb":  # per micro-batch scales: mb=4/2/1/1
                try:
                    kwargs["microbatch"] = tuple(float(v) for v in value.split("/"))
                except ValueError:
                    raise ValueError(f"bad cost {item!r}: mb= takes a scale per micro-batch "
                                     f"separated by '/', e.g. 'mb=4/2/1/1'") from None
                continue
            if not sep or name.strip() not in _FIELDS:
                raise ValueError(f"bad cost {item!r}: expected NAME=VALUE with NAME one of "
                                 f"{', '.join(_FIELDS)}, e.g. 'F=1,B=2,comm=0.1'")
            try:
                kwargs[_FIELDS[name.strip()]] = float(value)
            except ValueError:
                raise ValueError(f"bad cost {item!r}: {value!r} is not a number") from None
        return cls(**kwargs)

    def of(self, op: Op, stage: int) -> float:
        """The duration of `op` on `stage` (communication actions take none)."""
        name = _FIELDS.get(op.value)
        if name is None or name == "comm":
            return 0.0
        return self._value(name, stage)

    def of_action(self, action: Action) -> float:
        """The duration of `action`: its op on its stage, scaled by its micro-batch's cost."""
        base = self.of(action.op, action.stage)
        if not self.microbatch or action.op not in COMPUTE_OPS or action.op is Op.U:
            return base
        return base * self.microbatch[action.microbatch % len(self.microbatch)]

    def edge(self, key: tuple[int, Op, int]) -> float:
        """What a wait on the SEND `key` costs beside `comm`: tied weights' transfer time."""
        stage, op, index = key
        if op is Op.SEND_T:
            return self._value("tie", index)  # to copy stage `index`
        if op is Op.SEND_G:
            return self._value("tie", stage)  # from copy stage `stage`
        return 0.0

    def _value(self, name: str, stage: int) -> float:
        value = getattr(self, name)
        if isinstance(value, tuple):
            if stage >= len(value):
                raise ValueError(f"Costs.{name} has {len(value)} per-stage values but stage "
                                 f"{stage} was asked for; give one value per stage")
            return float(value[stage])
        return float(value)


@dataclass(frozen=True, slots=True, init=False)
class Event:
    """One action as it ran (or would run) on a rank."""

    rank: int
    action: Action
    start: float
    end: float

    # Fills the slots directly: twice as fast as a frozen dataclass's `__init__` (see Action).
    def __init__(self, rank: int, action: Action, start: float, end: float) -> None:
        _SET_RANK(self, rank)
        _SET_ACTION(self, action)
        _SET_START(self, start)
        _SET_END(self, end)

    @property
    def duration(self) -> float:
        return self.end - self.start


_SET_RANK, _SET_ACTION, _SET_START, _SET_END = (
    Event.__dict__[name].__set__ for name in ("rank", "action", "start", "end"))
_START: Callable[[Event], float] = attrgetter("start")
_END: Callable[[Event], float] = attrgetter("end")


def peak_activations(rows: Iterable[Iterable[Action]]) -> tuple[int, ...]:
    """Per rank, the most micro-batches (per stage) forwarded and not yet fully backwarded.

    A micro-batch's activations stay alive from F until its backward completes: B, or W when the
    backward is split (W still needs what I left behind).
    """
    peaks = []
    forward, backward, weight = Op.F, Op.B, Op.W
    for row in rows:
        live = peak = 0
        for a in row:
            op = a.op
            if op is forward:
                live += 1
                if live > peak:
                    peak = live
            elif op is backward or op is weight:
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


@dataclass(frozen=True)
class Timeline:
    """Start and end of every action on every rank: planned (simulated) or measured.

    `unit` is `"cost"` for simulated timelines and `"s"` for measured ones. Times are relative to
    the step's start.
    """

    num_ranks: int
    events: tuple[Event, ...]
    unit: str = "cost"
    meta: Mapping[str, Any] = field(default_factory=dict)

    @cached_property
    def _lanes(self) -> tuple[tuple[Event, ...], ...]:
        lanes: list[list[Event]] = [[] for _ in range(self.num_ranks)]
        for e in self.events:
            lanes[e.rank].append(e)
        return tuple(tuple(sorted(lane, key=_START)) for lane in lanes)

    def lane(self, rank: int) -> tuple[Event, ...]:
        """Events of one rank, in order of start."""
        return self._lanes[rank]

    @property
    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(map(_END, self.events)) - min(0.0, min(map(_START, self.events)))

    def busy(self, rank: int) -> float:
        """Time `rank` spends computing (communication actions are not work)."""
        return sum(e.end - e.start for e in self._lanes[rank] if e.action.op in COMPUTE_OPS)

    @property
    def rank_bubble(self) -> tuple[float, ...]:
        """Per rank, the idle fraction of the makespan."""
        span = self.makespan
        if span <= 0:
            return tuple(0.0 for _ in range(self.num_ranks))
        return tuple((span - self.busy(r)) / span for r in range(self.num_ranks))

    @property
    def bubble_fraction(self) -> float:
        """Idle rank-time over `num_ranks x makespan`."""
        total = self.num_ranks * self.makespan
        if total <= 0:
            return 0.0
        # One division, so integer costs give the correctly rounded closed form exactly.
        return (total - sum(self.busy(r) for r in range(self.num_ranks))) / total

    @property
    def peak_activations(self) -> tuple[int, ...]:
        return peak_activations(tuple(e.action for e in self.lane(r)) for r in
                                range(self.num_ranks))

    def to_json(self) -> str:
        """The timeline as JSON; `Timeline.from_json` reads it back."""
        return json.dumps({
            "format": "pipeline-timeline/1",
            "num_ranks": self.num_ranks,
            "unit": self.unit,
            "meta": dict(self.meta),
            "events": [[e.rank, str(e.action), e.start, e.end] for e in self.events],
        })

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        try:
            data = json.loads(text)
            if data.get("format") != "pipeline-timeline/1":
                raise ScheduleError(f"not a pipeline timeline (format {data.get('format')!r})")
            num_ranks = int(data["num_ranks"])
            if num_ranks < 1:
                raise ScheduleError(f"timeline num_ranks must be >= 1 (got {num_ranks})")
            events = tuple(Event(int(r), Action.parse(a), float(s), float(e))
                           for r, a, s, e in data["events"])
            for e in events:
                if not 0 <= e.rank < num_ranks:
                    raise ScheduleError(f"timeline event {e.action} on rank {e.rank}, outside "
                                        f"0..{num_ranks - 1} (num_ranks {num_ranks})")
                if not (math.isfinite(e.start) and math.isfinite(e.end)) or e.end < e.start:
                    raise ScheduleError(f"timeline event {e.action} on rank {e.rank} runs from "
                                        f"{e.start} to {e.end}; times must be finite and "
                                        f"end >= start")
            return cls(num_ranks, events, str(data.get("unit", "cost")),
                       dict(data.get("meta", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ScheduleError):
                raise
            raise ScheduleError(f"malformed timeline JSON: {exc}") from exc

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace events (Perfetto, chrome://tracing): a process per rank, one complete
        event per action, times in microseconds (cost units are shown as 1 unit = 1 ms)."""
        scale = 1e6 if self.unit == "s" else 1e3
        trace: list[dict[str, Any]] = []
        for r in range(self.num_ranks):
            trace.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                          "args": {"name": f"rank {r}"}})
        for e in self.events:
            trace.append({
                "name": str(e.action), "cat": e.action.op.value, "ph": "X", "pid": e.rank,
                "tid": 0, "ts": e.start * scale, "dur": e.duration * scale,
                "args": {"stage": e.action.stage, "microbatch": e.action.microbatch,
                         "op": e.action.op.value},
            })
        return {"traceEvents": trace, "displayTimeUnit": "ms", "metadata": dict(self.meta)}


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Time `schedule`: each rank runs its actions in order, each as soon as its inputs arrive.

    Raises `ScheduleError` if the schedule deadlocks (call `validate` for the full diagnosis).
    """
    starts, ends = _times(schedule, costs or Costs())
    events: list[Event] = []
    for r, row in enumerate(schedule.actions):
        events += map(Event, repeat(r), row, starts[r], ends[r])
    meta = {"schedule": schedule.name, "num_ranks": schedule.num_ranks,
            "num_stages": schedule.num_stages, "num_microbatches": schedule.num_microbatches,
            "num_batches": schedule.num_batches, "placement": schedule.placement}
    if schedule.syncs is not None:
        meta["syncs"] = str(schedule.syncs)
    return Timeline(schedule.num_ranks, tuple(events), "cost", meta)


def makespan(schedule: Schedule, costs: Costs | None = None) -> float:
    """`simulate(schedule, costs).makespan`, without making the timeline's events: what a
    choice between orders needs (the tokens cut times three at every step)."""
    starts, ends = _times(schedule, costs or Costs())
    if not any(map(len, ends)):
        return 0.0
    return max(chain.from_iterable(ends)) - min(0.0, min(chain.from_iterable(starts)))


def _times(schedule: Schedule, costs: Costs) -> tuple[list[list[float]], list[list[float]]]:
    """Per-rank start and end times of `schedule`'s actions; `ScheduleError` on a deadlock."""
    result = (_per_microbatch(schedule, costs) if costs.microbatch else
              execute_by_kind(schedule, costs.of, costs.comm, edge=costs.edge))  # by kind
    if not isinstance(result, tuple):
        blocked = ", ".join(f"rank {r} at step {i}" for r, (i, _) in sorted(result.blocked.items()))
        raise ScheduleError(f"cannot simulate {schedule.name}: deadlock ({blocked}); "
                            f"run schedules.validate for the marked grid")
    return result


def _per_microbatch(schedule: Schedule, costs: Costs
                   ) -> tuple[list[list[float]], list[list[float]]] | Deadlock:
    """`execute` under `costs.of_action`, over the schedule's kept graph: a program timed step
    after step under other micro-batch costs builds its graph once."""
    graph = graph_of(schedule)
    if graph.steps is not None:
        try:
            timed = run(graph, _durations(graph, costs), costs.comm, edge=costs.edge)
        except ValueError:  # a cost missing for a stage: `execute` says where it needs it
            timed = None
        if timed is not None:
            return timed
    return execute(schedule, costs.of_action, costs.comm, edge=costs.edge)


def _durations(graph: Graph, costs: Costs) -> list[float]:
    """Each action's `costs.of_action`, by number: one lookup per (op, stage), then the
    micro-batch's scale on compute ops but updates."""
    base = [costs.of(op, stage) for op, stage in graph.kinds]
    scales = costs.microbatch
    if not scales:
        return [base[k] for k in graph.kind_of]
    n = len(scales)
    scaled = [op in COMPUTE_OPS and op is not Op.U for op, _ in graph.kinds]
    return [base[k] * scales[a.microbatch % n] if scaled[k] else base[k]
            for k, a in zip(graph.kind_of, graph.actions, strict=True)]
