"""The validator: a schedule is complete, well placed, ordered, version-safe and deadlock-free."""

from __future__ import annotations

from collections import Counter

from schedules.graph import Key, execute
from schedules.ir import Op, Schedule, ScheduleError
from schedules.text import format_grid

__all__ = ["validate"]


def _fail(schedule: Schedule, message: str, marks: dict[int, int] | None = None) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, marks)}", reason=message,
                         marks=marks)


def _where(schedule: Schedule, key: Key) -> dict[int, int]:
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if (a.stage, a.op, a.microbatch) == key:
                return {rank: i}
    return {}


def _check_actions(schedule: Schedule) -> None:
    """Every action is in range, on the rank holding its stage, and appears once."""
    seen: Counter[Key] = Counter()
    total = schedule.total_microbatches
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            here = {rank: i}
            if a.stage >= schedule.num_stages:
                raise _fail(schedule, f"{a}: stage {a.stage} >= num_stages "
                            f"{schedule.num_stages}", here)
            limit = schedule.num_batches if a.op is Op.U else total
            if a.microbatch >= limit:
                what = "batch" if a.op is Op.U else "micro-batch"
                raise _fail(schedule, f"{a}: {what} {a.microbatch} is out of range (< {limit})",
                            here)
            if schedule.rank_of(a.stage) != rank:
                raise _fail(
                    schedule,
                    f"{a}: stage {a.stage} is placed on rank {schedule.rank_of(a.stage)} "
                    f"({schedule.placement} placement) but the action is on rank {rank}",
                    here,
                )
            key = (a.stage, a.op, a.microbatch)
            seen[key] += 1
            if seen[key] > 1:
                raise _fail(schedule, f"{a} appears more than once", here)


def _check_complete(schedule: Schedule) -> None:
    """Each (stage, micro-batch) has one F and one B, or one I and one W; 2BW: one U per batch."""
    present = {(a.stage, a.op, a.microbatch) for row in schedule.actions for a in row}
    versioned = any(a.version is not None for row in schedule.actions for a in row)
    has_updates = any(a.op is Op.U for row in schedule.actions for a in row)
    for s in range(schedule.num_stages):
        for m in range(schedule.total_microbatches):
            if (s, Op.F, m) not in present:
                raise _fail(schedule, f"missing forward {s}F{m} (stage {s}, micro-batch {m})")
            full = (s, Op.B, m) in present
            split = ((s, Op.I, m) in present, (s, Op.W, m) in present)
            if full and any(split):
                raise _fail(schedule, f"stage {s} micro-batch {m} has both B and I/W backward",
                            _where(schedule, (s, Op.B, m)))
            if not full and split != (True, True):
                part = "I" if not split[0] else "W"
                raise _fail(schedule, f"missing backward for stage {s} micro-batch {m}: "
                            f"need {s}B{m}, or both {s}I{m} and {s}W{m} (no {s}{part}{m})")
        if has_updates or schedule.num_batches > 1:
            for b in range(schedule.num_batches):
                if (s, Op.U, b) not in present:
                    raise _fail(schedule, f"missing weight update {s}U{b} (stage {s}, batch {b})")
    if (has_updates or schedule.num_batches > 1) and not versioned:
        raise _fail(schedule, "a multi-batch (2BW) schedule must tag F/B/I/W with weight versions")


def _check_versions(schedule: Schedule) -> None:
    """2BW: batch b computes with version b; a micro-batch's F and backward share it; <= 2 live.

    Versions 0 and 1 exist at the start (the previous and the current weights); update U(s, b)
    turns version b + 1 and batch b's gradients into version b + 2, and version b is dropped once
    batch b's backward passes are done. Counted along each rank's order, per stage.
    """
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if a.op in (Op.F, Op.B, Op.I, Op.W):
                want = schedule.batch_of(a.microbatch)
                if a.version != want:
                    raise _fail(schedule, f"{a}: micro-batch {a.microbatch} is in batch {want} "
                                f"and must compute with weight version {want}, not "
                                f"{a.version}", {rank: i})
            elif a.op is Op.U and a.version is not None:
                raise _fail(schedule, f"{a}: an update carries no version tag", {rank: i})
    per_batch = schedule.num_microbatches
    for rank, row in enumerate(schedule.actions):
        for stage in schedule.stages_of(rank):
            live = {0, 1}
            pending: Counter[int] = Counter()  # version -> backward passes still to run
            forwarded: Counter[int] = Counter()
            for i, a in enumerate(row):
                if a.stage != stage or a.op is Op.I:
                    continue
                v = a.version
                if a.op is Op.F and v is not None:
                    if v not in live:
                        raise _fail(schedule, f"{a}: weight version {v} is not live on stage "
                                    f"{stage} here (live: {sorted(live)})", {rank: i})
                    pending[v] += 1
                    forwarded[v] += 1
                elif a.op in (Op.B, Op.W) and v is not None:
                    pending[v] -= 1
                    if pending[v] == 0 and forwarded[v] == per_batch and v != max(live):
                        live.discard(v)  # batch v is done with it, and it is not the newest
                elif a.op is Op.U:
                    live.add(a.microbatch + 2)
                    if len(live) > 2:
                        raise _fail(schedule, f"{a}: would hold {len(live)} weight versions "
                                    f"{sorted(live)} on stage {stage}; 2BW keeps at most two",
                                    {rank: i})


def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` and return it; raise `ScheduleError` showing the grid marked where it fails.

    Rules: actions in range and on the rank holding their stage, none repeated; every stage and
    micro-batch runs F once and B once (or I and W once); F(s,m) after F(s-1,m); B(s,m) after
    B(s+1,m) and F(s,m); W after I; 2BW weight versions; and no deadlock when every rank runs its
    list in order with blocking receives (sends never block).
    """
    _check_actions(schedule)
    _check_complete(schedule)
    if any(a.version is not None for row in schedule.actions for a in row):
        _check_versions(schedule)
    result = execute(schedule, lambda a: 1.0)
    if not isinstance(result, tuple):
        lines = []
        for rank, (i, missing) in sorted(result.blocked.items()):
            want = ", ".join(f"{s}{op.value}{m}" for s, op, m in missing) or "nothing"
            lines.append(f"  rank {rank} step {i} ({schedule.actions[rank][i]}) waits for {want}")
        raise _fail(
            schedule,
            "deadlock: these ranks wait on each other (or on an action ordered after them):\n"
            + "\n".join(lines),
            {r: i for r, (i, _) in result.blocked.items()},
        )
    return schedule
