"""The anatomy of a measured step: what each rank recorded, split into parts that add up to it.

A rank's step, from the first rank's `pipe.step` call to the last one's return, is cut into
compute (its forward, backward and weight passes), the runtime between its actions (the
SEND/RECV actions and the interpreter's gaps), waits for a peer's message, syncs (a program's
sync actions, the end of the step's sends, the loss sent to every rank) and the time outside
the schedule (before its first action and after its last, and the step's time before its own
call and after its own return). Each instant of the step is counted once: the parts are
measured, not derived as a remainder, and add up to the step. `critical_path` splits the step
once more, along the chain of actions and messages that set its length. Pure Python: no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schedules import Action, Op, Timeline
from schedules import Event as TimelineEvent
from schedules.ir import COMPUTE_OPS, SEND_OPS
from schedules.lower import Message
from schedules.lower import message as message_of

__all__ = ["PARTS", "PATH_PARTS", "RankAnatomy", "RankRecord", "StepRecord", "critical_path",
           "excess", "ideal_step", "mean_anatomy", "message_label", "split_step", "timeline_of"]

Span = tuple[float, float]
PARTS = ("compute", "runtime", "wait", "sync", "outside")
PATH_PARTS = ("compute", "runtime", "transit", "sync", "outside")
_OPS = {Op.F: "forward", Op.B: "backward", Op.I: "input grad", Op.W: "weight grad",
        Op.U: "update"}
_PHASES = {"finish": ("sync", "sends complete (end of step)"),
           "share": ("sync", "loss to every rank"),
           "begin": ("outside", "receives posted (begin)")}


@dataclass(frozen=True)
class RankRecord:
    """What one rank recorded in one step; absolute seconds on a clock every rank shares.

    `call`: its `pipe.step` call and return; `run`: its first action's start and last one's
    end; `actions`: compute and sync actions as text (`"1F3"`) with start and end (from the
    handler having its inputs); `comm`: SEND/RECV actions; `waits`: each wait for a peer's
    message; `phases`: the executor's "begin", "finish" and "share" (those that ran)."""

    rank: int
    call: Span
    run: Span
    actions: tuple[tuple[str, float, float], ...]
    comm: tuple[tuple[str, float, float], ...] = ()
    waits: tuple[tuple[Message, float, float], ...] = ()
    phases: Mapping[str, Span] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "call": list(self.call), "run": list(self.run),
                "actions": [list(a) for a in self.actions], "comm": [list(c) for c in self.comm],
                "waits": [[list(m), s, e] for m, s, e in self.waits],
                "phases": {k: list(v) for k, v in self.phases.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankRecord:
        return cls(int(data["rank"]), _span(data["call"]), _span(data["run"]),
                   tuple((str(a), float(s), float(e)) for a, s, e in data["actions"]),
                   tuple((str(a), float(s), float(e)) for a, s, e in data.get("comm", ())),
                   tuple(((str(m[0]), int(m[1]), int(m[2])), float(s), float(e))
                         for m, s, e in data.get("waits", ())),
                   {str(k): _span(v) for k, v in data.get("phases", {}).items()})


def _span(value: Sequence[float]) -> Span:
    return float(value[0]), float(value[1])


StepRecord = Sequence[RankRecord]  # every rank of one step


@dataclass(frozen=True)
class RankAnatomy:
    """Where one rank's share of a step went, in seconds. `parts` (PARTS) add up to `step`;
    `detail` splits each part; `messages` the waits by message (`message_label`); `overlap`
    is time two records both claimed (counted once; 0 when the record is consistent)."""

    rank: int
    step: float
    parts: Mapping[str, float]
    detail: Mapping[str, Mapping[str, float]]
    messages: Mapping[str, float]
    overlap: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step_s": self.step, "parts_s": dict(self.parts),
                "detail_s": {k: dict(v) for k, v in self.detail.items()},
                "messages_s": dict(self.messages), "overlap_s": self.overlap}


def message_label(msg: Sequence[Any]) -> str:
    """`F1:3`: the activations into stage 1 of micro-batch 3 (`B0:3`, its gradients into 0)."""
    return f"{msg[0]}{msg[1]}:{msg[2]}"


@dataclass(frozen=True)
class _Producers:
    """Per message: the rank and end of the action that produced it, and when its SEND
    returned."""

    made: Mapping[Message, tuple[int, float]]
    sent: Mapping[Message, float]

    @classmethod
    def of(cls, step: StepRecord) -> _Producers:
        made: dict[Message, tuple[int, float]] = {}
        sent: dict[Message, float] = {}
        for rec in step:
            for text, _, end in rec.actions:
                a = Action.parse(text)
                if a.op is Op.F:
                    made[("F", a.stage + 1, a.microbatch)] = (rec.rank, end)
                elif a.op in (Op.B, Op.I):
                    made[("B", a.stage - 1, a.microbatch)] = (rec.rank, end)
            for text, _, end in rec.comm:
                a = Action.parse(text)
                if a.op in SEND_OPS:
                    sent[message_of(a)] = end
        return cls(made, sent)

    def times(self, msg: Message, default: float) -> tuple[float, float]:
        """When `msg` was produced and when it had left (its SEND returned, if later);
        `default` for both where its producer is unknown (a tie's values, say)."""
        produced = self.made[msg][1] if msg in self.made else default
        return produced, max(self.sent.get(msg, produced), produced)


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


# One stretch of a rank's step: start, end, part, what (a message for a wait).
_Segment = tuple[float, float, str, Any]


def split_step(step: StepRecord) -> list[RankAnatomy]:
    """Every rank's anatomy of one step (the records of all its ranks). The step runs from the
    first rank's call to the last one's return, so a rank's time before its own call and after
    its own return counts as outside the schedule, and every rank's parts add up to the same
    step. Each instant is given to the record covering it (the earlier one where two overlap:
    `overlap` says how much), else to the runtime inside the run and to outside beyond it."""
    lo, hi = _bounds(step)
    producers = _Producers.of(step)
    return [_anatomy(rec, *_segments(rec, lo, hi), hi - lo, producers) for rec in step]


def _bounds(step: StepRecord) -> tuple[float, float]:
    if not step:
        raise ValueError("a step needs the record of at least one rank")
    return min(r.call[0] for r in step), max(r.call[1] for r in step)


def _intervals(rec: RankRecord) -> list[_Segment]:
    out: list[_Segment] = []
    for text, s, e in rec.actions:
        op = Action.parse(text).op
        if op in COMPUTE_OPS:
            out.append((s, e, "compute", _OPS[op]))
        else:
            out.append((s, e, "sync", f"{op.value} actions"))
    out += [(s, e, "runtime", "SEND actions" if Action.parse(text).op in SEND_OPS else
             "RECV actions (posting)") for text, s, e in rec.comm]
    out += [(s, e, "wait", msg) for msg, s, e in rec.waits]
    for name, (s, e) in rec.phases.items():
        part, what = _PHASES.get(name, ("outside", name))
        out.append((s, e, part, what))
    return sorted(out, key=lambda t: (t[0], t[1]))


def _segments(rec: RankRecord, lo: float, hi: float) -> tuple[list[_Segment], float]:
    """The rank's step [lo, hi] as contiguous segments, and the seconds two records claimed."""
    run_lo, run_hi = rec.run
    call_lo, call_hi = rec.call
    out: list[_Segment] = []
    overlap = 0.0

    def gap(a: float, b: float) -> None:
        """Nothing recorded in [a, b): the runtime inside the run, outside the schedule beyond
        (before this rank's call or after its return, the other ranks are still in the step)."""
        for part, what, x, y in (("outside", "before its call", lo, call_lo),
                                 ("outside", "before the first action", call_lo, run_lo),
                                 ("runtime", "between actions", run_lo, run_hi),
                                 ("outside", "after the last action", run_hi, call_hi),
                                 ("outside", "after its return", call_hi, hi)):
            x, y = max(a, x), min(b, y)
            if y > x:
                out.append((x, y, part, what))

    cursor = lo
    for s, e, part, what in _intervals(rec):
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if s > cursor:
            gap(cursor, s)
        overlap += max(0.0, min(e, cursor) - s)
        if e > cursor:
            out.append((max(s, cursor), e, part, what))
        cursor = max(cursor, e)
    if cursor < hi:
        gap(cursor, hi)
    return sorted(out, key=lambda t: t[0]), overlap


def _anatomy(rec: RankRecord, segments: Sequence[_Segment], overlap: float, step: float,
             producers: _Producers) -> RankAnatomy:
    detail: dict[str, dict[str, float]] = {p: {} for p in PARTS}
    messages: dict[str, float] = {}

    def add(part: str, what: str, seconds: float) -> None:
        if seconds > 0:
            detail[part][what] = detail[part].get(what, 0.0) + seconds

    for a, b, part, what in segments:
        if part != "wait":
            add(part, str(what), b - a)
            continue
        label = message_label(what)
        messages[label] = messages.get(label, 0.0) + b - a
        produced, left = producers.times(what, a)
        add("wait", "peer computing", _overlap(a, b, a, produced))
        add("wait", "peer sending", _overlap(a, b, produced, left))
        add("wait", "in transit", _overlap(a, b, left, b))
    parts = {p: sum(detail[p].values()) for p in PARTS}
    return RankAnatomy(rec.rank, step, parts, detail, messages, overlap)


def critical_path(step: StepRecord) -> dict[str, float]:
    """The step along its critical path, by part (PATH_PARTS; they add up to the step): from
    the last return back to the first call, on one rank until it waited for a peer's message,
    then on the peer from the moment the message had left (its SEND returned; or its producer
    ended, if the receiver had it first). The wait after that moment is `transit`; a wait for
    a message that had left before the wait began is all transit too (the receive itself)."""
    lo, hi = _bounds(step)
    producers = _Producers.of(step)
    lanes = {rec.rank: _segments(rec, lo, hi)[0] for rec in step}
    ends = {r: [seg[1] for seg in lane] for r, lane in lanes.items()}
    out = dict.fromkeys(PATH_PARTS, 0.0)
    rank = max(step, key=lambda rec: rec.call[1]).rank
    t = hi
    for _ in range(4 * sum(len(lane) for lane in lanes.values()) + 4):
        if t <= lo:
            break
        a, b, part, what = lanes[rank][min(bisect.bisect_left(ends[rank], t),
                                           len(ends[rank]) - 1)]
        b = min(b, t)
        if part == "wait" and what in producers.made:
            src = producers.made[what][0]
            produced, left = producers.times(what, a)
            jump = left if left <= b else produced  # the receiver may wake before SEND returns
            if a < jump <= b and src != rank:
                out["transit"] += b - jump
                rank, t = src, jump
                continue
        out["transit" if part == "wait" else part] += b - a
        t = a
    return out
def mean_anatomy(anatomies: Sequence[RankAnatomy]) -> RankAnatomy:
    """The mean of one rank's anatomies over several steps: means add up as the parts do."""
    if not anatomies:
        raise ValueError("the mean of no anatomies")
    n = len(anatomies)

    def mean(maps: Iterable[Mapping[str, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in maps:
            for k, v in m.items():
                out[k] = out.get(k, 0.0) + v / n
        return out

    return RankAnatomy(anatomies[0].rank, sum(a.step for a in anatomies) / n,
                       {p: sum(a.parts[p] for a in anatomies) / n for p in PARTS},
                       {p: mean(a.detail[p] for a in anatomies) for p in PARTS},
                       mean(a.messages for a in anatomies),
                       sum(a.overlap for a in anatomies) / n)


def ideal_step(alone: Sequence[float], num_microbatches: int, num_ranks: int,
               stages_per_rank: int = 1) -> float:
    """The ideal pipeline of the same split: the slowest rank's compute alone (every rank's
    measured at the same time, so they contend as in the pipeline) times the bubble of 1F1B
    (and GPipe), (m + p - 1) / m; with v stages per rank, 1 + (p - 1) / (v m)."""
    if not alone:
        raise ValueError("the ideal needs each rank's compute alone")
    v = stages_per_rank
    return max(alone) * (1 + (num_ranks - 1) / (v * num_microbatches))


def excess(anatomy: RankAnatomy, alone: float, ideal: float) -> dict[str, float]:
    """The step beyond the ideal, `step - ideal`, split as one rank sees it: its compute beyond
    the same compute alone; its idle time (waits for a peer, and the step's time before its
    own call and after its own return) beyond the ideal's idle time on it, `ideal - alone`;
    and all of its runtime, syncs and time outside the schedule within its own call."""
    p, out = anatomy.parts, anatomy.detail["outside"]
    away = out.get("before its call", 0.0) + out.get("after its return", 0.0)
    return {"compute": p["compute"] - alone, "wait": p["wait"] + away - (ideal - alone),
            "runtime": p["runtime"], "sync": p["sync"], "outside": p["outside"] - away,
            "total": anatomy.step - ideal}


def timeline_of(step: StepRecord, meta: Mapping[str, Any] | None = None) -> Timeline:
    """The step's measured timeline (compute and sync actions of every rank), in seconds from
    the first rank's call, as pipeviz draws it; meta's "t0" is that call."""
    lo = min(r.call[0] for r in step)
    events = sorted((TimelineEvent(r.rank, Action.parse(text), s - lo, e - lo)
                     for r in step for text, s, e in r.actions),
                    key=lambda ev: (ev.start, ev.rank))
    return Timeline(max(r.rank for r in step) + 1, tuple(events), "s",
                    {**(meta or {}), "t0": lo})
