"""A time model fitted from measured steps: compute, contention, per-action, message, step.

The planner prices a step from a profile of each layer alone and a link's time per message.
Measured steps add what neither holds: compute at another speed than the profile's (caches,
the allocator, another thread count), slowed further while another rank computes at once; the
runtime's own time per action (dispatch, wake-ups) and per message (beyond the link's bytes);
the step's time outside its actions (the loss sent to every rank, the end of the sends); and
the dp all-reduce as it costs a rank (its flattening copies and the copies back included).
`fit_time_model` fits each term from pairs of a measured timeline and the planner's prediction
of the same configuration (no model applied), and `plan(..., time_model=m)` prices every
candidate with them. A model is stored per machine (`save`, `load`): a fit is only as good as
the machine it was measured on.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline.errors import PipeConfigError
from schedules import Action, Costs, Event, Op, Timeline
from schedules.files import read_json
from schedules.ir import COMPUTE_OPS
from schedules.lower import consumed, source_stage

__all__ = ["MAX_FILE_BYTES", "Sample", "TimeModel", "compute_spans", "fit_time_model",
           "machine", "message_waits", "producer", "reduce_tails"]

_COMPUTE = (Op.F, Op.B, Op.I, Op.W)
MAX_FILE_BYTES = 1 << 20  # a saved model is a few hundred bytes, a term per micro-batch size


def machine() -> dict[str, str]:
    """What a fit depends on: the host, its processor count, the torch build, the GPU."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return {"host": platform.node(), "cpus": str(os.cpu_count()),
            "processor": platform.machine(), "torch": torch.__version__, "gpu": gpu}


@dataclass(frozen=True)
class TimeModel:
    """Terms fitted from measured steps (seconds), applied on top of a profile and a link.

    `compute`: measured / profiled compute of a rank computing alone; `rows`: that scale for
    micro-batches of so many rows, where it was fitted apart (a profile errs by its own amount
    at each size; other sizes take `compute`); `contention`: the further slowdown of compute
    overlapping another rank's (1 = none); `action`: seconds each compute action adds;
    `message`: seconds each cross-rank message adds to the link's time; `step`: seconds a
    step spends outside its actions; `allreduce`: measured / predicted dp all-reduce.
    `samples`: the measured steps it was fitted on; `machine`: where."""

    compute: float = 1.0
    contention: float = 1.0
    action: float = 0.0
    message: float = 0.0
    step: float = 0.0
    allreduce: float = 1.0
    samples: int = 0
    machine: Mapping[str, str] = field(default_factory=dict)
    rows: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        terms = [(n, getattr(self, n)) for n in ("compute", "contention", "action", "message",
                                                  "step", "allreduce")]
        for name, value in terms + [(f"rows[{k}]", v) for k, v in self.rows.items()]:
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value)):
                raise PipeConfigError(f"TimeModel.{name} must be a finite number (got "
                                      f"{value!r})")
        for name in ("compute", "allreduce"):
            if not getattr(self, name) > 0:
                raise PipeConfigError(f"TimeModel.{name} must be > 0 (got {getattr(self, name)})")
        if not self.contention >= 1:
            raise PipeConfigError(f"TimeModel.contention must be >= 1 (got {self.contention})")
        for name in ("action", "message", "step"):
            if not getattr(self, name) >= 0:
                raise PipeConfigError(f"TimeModel.{name} must be >= 0 seconds (got "
                                      f"{getattr(self, name)})")
        if not all(v > 0 for v in self.rows.values()):
            raise PipeConfigError(f"TimeModel.rows' scales must be > 0 (got {dict(self.rows)})")
        if (not isinstance(self.samples, int) or isinstance(self.samples, bool)
                or self.samples < 0):
            raise PipeConfigError(f"TimeModel.samples must be a whole number >= 0 (got "
                                  f"{self.samples!r})")

    def costs(self, costs: Costs, rows: int | None = None) -> Costs:
        """`costs` (from a profile and a link, for micro-batches of `rows` rows) as this
        machine runs them, contention aside."""
        compute = self.rows.get(rows, self.compute) if rows is not None else self.compute

        def scaled(value: float | Sequence[float], factor: float, add: float = 0.0
                   ) -> tuple[float, ...] | float:
            if isinstance(value, int | float):
                return value * factor + add
            return tuple(v * factor + add for v in value)

        def timed(value: float | Sequence[float]) -> tuple[float, ...] | float:
            return scaled(value, compute, self.action)

        return Costs(forward=timed(costs.forward), backward=timed(costs.backward),
                     backward_input=timed(costs.backward_input),
                     backward_weight=timed(costs.backward_weight), update=costs.update,
                     comm=costs.comm + self.message, tie=costs.tie,
                     reduce_grad=scaled(costs.reduce_grad, self.allreduce),
                     overflow=costs.overflow, microbatch=costs.microbatch)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model as JSON (with the machine it was fitted on)."""
        from schedules.files import write_atomic

        write_atomic(Path(path), json.dumps(asdict(self) | {
            "machine": dict(self.machine), "rows": {str(k): v for k, v in self.rows.items()}},
            indent=1).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, any_machine: bool = False) -> TimeModel:
        """Read a saved model; one fitted on another machine is refused unless `any_machine`.
        Through the file gate (`schedules.files`): a regular file of at most
        `MAX_FILE_BYTES`, no link another user planted, nothing nested deep."""
        try:
            data = read_json(path, limit=MAX_FILE_BYTES, max_depth=4)
            if not isinstance(data, dict) or not isinstance(data.get("machine"), dict):
                raise TypeError("it holds no object with a machine")
            model = cls(**{k: data[k] for k in ("compute", "contention", "action", "message",
                                               "step", "allreduce", "samples")},
                        machine={str(k): str(v) for k, v in data["machine"].items()},
                        rows={int(k): float(v) for k, v in data.get("rows", {}).items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PipeConfigError(f"{path}: not a saved TimeModel ({exc}); fit one with "
                                  f"fit_time_model(...) and save it") from exc
        here = machine()
        if not any_machine and dict(model.machine) != here:
            moved = sorted(k for k in here if model.machine.get(k) != here[k])
            raise PipeConfigError(f"{path} was fitted on another machine ({', '.join(moved)} "
                                  f"differ: {[model.machine.get(k) for k in moved]} here "
                                  f"{[here[k] for k in moved]}); fit it again here, or pass "
                                  f"any_machine=True to use it anyway")
        return model


@dataclass(frozen=True)
class Sample:
    """One measured step beside its prediction: `measured` (`pipe.last_timeline()`; under dp,
    one replica's), `predicted` (the planner's timeline of the same configuration, no time
    model and no contention: `predict(...).timeline`), `step` the measured step's seconds;
    under dp, `beside`: (start, end) of every compute action of the other replicas' ranks, on
    `measured`'s clock (they slow this replica's compute as another stage's would); `rows`:
    its micro-batches' rows, when the compute scale is to be fitted per size."""

    measured: Timeline
    predicted: Timeline
    step: float
    beside: tuple[tuple[float, float], ...] = ()
    rows: int | None = None


Key = tuple[int, Op, int]


def compute_spans(events: Iterable[tuple[int, str, float, float]], start: float
                  ) -> tuple[tuple[float, float], ...]:
    """The compute actions among raw events (rank, action, start, end) as (start, end) from
    `start`: for another replica's events, a `Sample`'s `beside`."""
    return tuple((s - start, e - start) for _, a, s, e in events
                 if Action.parse(a).op in COMPUTE_OPS)


def _index(t: Timeline) -> dict[Key, Event]:
    return {(e.action.stage, e.action.op, e.action.microbatch): e for e in t.events}


def producer(events: Mapping[Key, Event], action: Action, num_stages: int) -> Event | None:
    """The event whose output `action` consumes from an adjacent stage (None: its input is
    local); `events` keyed by (stage, op, micro-batch)."""
    msg = consumed(action, num_stages)
    if msg is None:
        return None
    src, mb = source_stage(msg), action.microbatch
    if msg[0] == "F":
        return events.get((src, Op.F, mb))
    return events.get((src, Op.B, mb)) or events.get((src, Op.I, mb))


def message_waits(t: Timeline) -> list[float]:
    """Per input from a peer that a rank sat idle for (its previous action ended before the
    input's producer did): its start less the producer's end, transfer and no queueing."""
    events = _index(t)
    stages = 1 + max((e.action.stage for e in t.events), default=0)
    out = []
    for r in range(t.num_ranks):
        lane = t.lane(r)
        for prev, e in zip((None, *lane), lane, strict=False):
            src = producer(events, e.action, stages)
            if src is not None and src.rank != e.rank and (prev is None or prev.end <= src.end):
                out.append(e.start - src.end)
    return out


def _shares(t: Timeline, beside: Sequence[tuple[float, float]] = ()) -> dict[Key, float]:
    """Per compute action, the share of it during which another rank was computing (one of
    `t`'s, or of another replica: `beside`)."""
    computing = [e for e in t.events if e.action.op in _COMPUTE]
    out = {}
    for e in computing:
        length = e.end - e.start
        others = [(o.start, o.end) for o in computing if o.rank != e.rank] + list(beside)
        covered = sorted((max(lo, e.start), min(hi, e.end)) for lo, hi in others
                         if lo < e.end and hi > e.start)
        total, reach = 0.0, e.start
        for lo, hi in covered:  # the union: two other ranks at once count once
            if hi > reach:
                total += hi - max(lo, reach)
                reach = hi
        out[(e.action.stage, e.action.op, e.action.microbatch)] = (
            total / length if length > 0 else 0.0)
    return out


def reduce_tails(t: Timeline) -> dict[int, float]:
    """Per rank that averages gradients over dp, what that costs it: the seconds from its first
    REDUCE_GRAD's start to its AWAIT_GRAD's end, less its compute actions between. Measured,
    that is the flattening copies, the wait for the reduction and the copies back; predicted,
    the part of the (background) reduction no compute hides."""
    out = {}
    for r in range(t.num_ranks):
        lane = t.lane(r)
        launches = [e.start for e in lane if e.action.op is Op.REDUCE_GRAD]
        waits = [e.end for e in lane if e.action.op is Op.AWAIT_GRAD]
        if launches and waits:
            start, end = min(launches), max(waits)
            busy = sum(e.end - e.start for e in lane
                       if e.action.op in _COMPUTE and e.start >= start and e.end <= end)
            out[r] = end - start - busy
    return out


def _span(t: Timeline) -> float:
    starts = [e.start for e in t.events]
    return max(e.end for e in t.events) - min(starts) if starts else 0.0


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (the columns are few: drop the most
    negative and fit again)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        got, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (got >= 0).all():
            coef[active] = got
            return coef
        active.pop(int(np.argmin(got)))
    return coef


def fit_time_model(samples: Iterable[Sample]) -> TimeModel:
    """Fit every term from measured steps and their predictions (module docstring): each
    compute action's measured seconds as `compute * p + (contention - 1) * compute * p *
    share + action` (p its predicted seconds, share the part of it another rank computed
    during; with `Sample.rows`, one compute scale per size, `compute` their mean weighted by
    predicted compute), least squares with no term negative; the message term as the median of the
    waits for a peer's output less the predicted link time; the step term as the median of
    the step less its actions' span; the all-reduce as the median over ranks and steps of
    measured / predicted `reduce_tails` (a rank whose prediction hides it all is left out)."""
    samples = list(samples)
    if not samples:
        raise PipeConfigError("fit_time_model needs at least one measured step (a Sample)")
    sizes = sorted({s.rows for s in samples if s.rows is not None})
    column = {r: i for i, r in enumerate(sizes)}
    group = len(sizes)  # the compute column of samples with no rows given
    rows: list[list[float]] = []
    seconds, gaps, outside, reduce = [], [], [], []
    for s in samples:
        if s.measured.unit != "s":
            raise PipeConfigError(f"Sample.measured must be a measured timeline (unit 's', "
                                  f"from pipe.last_timeline()); got unit {s.measured.unit!r}")
        want, got = _index(s.predicted), _index(s.measured)
        at = column.get(s.rows, group) if s.rows is not None else group
        for key, share in _shares(s.measured, s.beside).items():
            if key in want:
                p = want[key].end - want[key].start
                row = [0.0] * (group + 1) + [p * share, 1.0]
                row[at] = p
                rows.append(row)
                seconds.append(got[key].end - got[key].start)
        link = statistics.median(message_waits(s.predicted) or [0.0])
        gaps += [g - link for g in message_waits(s.measured)]
        outside.append(s.step - _span(s.measured))
        tails = reduce_tails(s.predicted)
        reduce += [got / tails[r] for r, got in reduce_tails(s.measured).items()
                   if tails.get(r, 0.0) > 1e-12]
    if not rows:
        raise PipeConfigError("fit_time_model: no action of the measured steps is in their "
                              "predictions: pair each measured step with its own configuration")
    x = np.array(rows)
    used = [i for i in range(group + 1) if x[:, i].any()]
    *scales, h, a = _nonnegative_fit(x[:, [*used, group + 1, group + 2]], np.array(seconds))
    # The scale over every size: each size's weighted by its predicted compute.
    fitted = [(float(x[:, i].sum()), v) for i, v in zip(used, scales, strict=True) if v > 0]
    g = sum(w * v for w, v in fitted) / sum(w for w, _ in fitted) if fitted else 0.0
    by_rows = {sizes[i]: float(v) for i, v in zip(used, scales, strict=True)
               if i < group and v > 0 and len(used) > 1}
    # No compute term at all (the runtime's own cost swamps the profile's): a scale near 0,
    # and no contention to scale.
    compute, contention = (g, 1 + h / g) if g > 0 else (1e-6, 1.0)
    return TimeModel(compute=float(compute), contention=float(contention), rows=by_rows,
                     action=float(a), message=max(0.0, statistics.median(gaps or [0.0])),
                     step=max(0.0, statistics.median(outside)),
                     allreduce=statistics.median(reduce) if reduce else 1.0,
                     samples=len(samples), machine=machine())
