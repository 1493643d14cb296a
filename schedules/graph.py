"""A schedule's dependency graph and its in-order execution (shared by validate and simulate).

`prerequisites` states the graph, by key, and `execute` runs it for any schedule, well-formed
or not (the error reports come from here). `schedules.planned` runs the same graph by action
number for well-formed schedules, in a fraction of the time.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

from schedules.ir import SYNC_OPS, Action, Op, Schedule
from schedules.lower import Message, consumed, message, recv_action, send_action, source_stage
from schedules.program import infer, sync_prerequisites

__all__ = ["Deadlock", "Key", "deadlock", "execute", "key_of", "prerequisites"]

Key = tuple[int, Op, int]  # (stage, op, micro-batch); one action per key in a valid schedule


def key_of(action: Action) -> Key:
    """An action's key: (stage, op, micro-batch)."""
    return (action.stage, action.op, action.microbatch)


@dataclass(frozen=True, slots=True)
class Deadlock:
    """Ranks that can make no progress: each blocked position and the keys it waits for."""

    blocked: dict[int, tuple[int, tuple[Key, ...]]]  # rank -> (position, missing prerequisites)


def prerequisites(schedule: Schedule) -> Callable[[Action], tuple[Key, ...]]:
    """Return a function giving the actions each action must wait for.

    A compute action depends on the producer of the data it consumes. In a lowered schedule
    (with SEND/RECV) a cross-rank input instead comes through a RECV on the consumer's rank,
    which must have been posted earlier on that rank, and the matching SEND on the producer's
    rank, which follows the producer. Receives are posted without blocking and sends never
    block (torch's irecv/isend): the consumer is what waits. A cycle in this graph is a deadlock.
    A program's syncs wait for what `schedules.program.sync_prerequisites` says.
    """
    present: set[Key] = {key_of(a) for row in schedule.actions for a in row}
    syncs = schedule.syncs
    if syncs is None and any(key[1] in SYNC_OPS for key in present):
        syncs = infer(schedule)
    extra = (None if syncs is None or syncs.empty
             else sync_prerequisites(schedule, syncs, present))
    lowered = schedule.has_comms
    n = schedule.num_stages
    per_batch = schedule.num_microbatches
    rank_of = schedule.rank_of

    def producer(msg: Message) -> Key:
        # A gradient comes from B or, when the backward is split, from I.
        kind, _, mb = msg
        src = source_stage(msg)
        if kind == "F":
            return (src, Op.F, mb)
        return (src, Op.I, mb) if (src, Op.I, mb) in present else (src, Op.B, mb)

    def data(a: Action) -> list[Key]:
        msg = consumed(a, n)
        if msg is None:
            return []
        if lowered and rank_of(source_stage(msg)) != rank_of(a.stage):
            return [key_of(recv_action(msg)), key_of(send_action(msg))]
        return [producer(msg)]

    def deps(a: Action) -> tuple[Key, ...]:
        s, op, mb = a.stage, a.op, a.microbatch
        if extra is not None and op in SYNC_OPS:
            return extra(a)
        if op is Op.F:
            out = data(a)
            if a.version is not None and a.version >= 2:
                out.append((s, Op.U, a.version - 2))  # version v is made by update v - 2
            if extra is not None:
                out += extra(a)
            return tuple(out)
        if op in (Op.B, Op.I):
            return ((s, Op.F, mb), *data(a))
        if op is Op.W:
            return ((s, Op.I, mb),)
        if op is Op.U:
            first = mb * per_batch
            return tuple(
                (s, Op.W, m) if (s, Op.W, m) in present else (s, Op.B, m)
                for m in range(first, first + per_batch)
            )
        if op in (Op.SEND_F, Op.SEND_B):
            return (producer(message(a)),)
        return ()  # RECV: posting a receive waits for nothing

    return deps


def execute(
    schedule: Schedule,
    duration: Callable[[Action], float],
    latency: float = 0.0,
    *,
    edge: Callable[[Key], float] | None = None,
) -> tuple[list[list[float]], list[list[float]]] | Deadlock:
    """Run every rank's list in order, each action as soon as its rank and prerequisites allow.

    Returns per-rank start and end times, or a `Deadlock` when some rank can never proceed.
    An edge between ranks costs `latency`, plus `edge(key)` for a wait on the action `key`
    (the transfer a SEND starts). A `REDUCE_GRAD` runs in the background: it takes no time of
    its rank, and the reductions of a rank run one after the other from their launches (its
    end is when its reduction would be done). Linear in the actions and dependencies.
    """
    deps = prerequisites(schedule)
    rows = schedule.actions
    starts: list[list[float]] = [[0.0] * len(row) for row in rows]
    ends: list[list[float]] = [[0.0] * len(row) for row in rows]
    done: dict[Key, tuple[int, float]] = {}  # key -> (rank, end time)
    waiting: dict[Key, list[int]] = {}
    pointer = [0] * len(rows)
    free_at = [0.0] * len(rows)
    link_free = [0.0] * len(rows)  # when each rank's background reductions are done
    todo = list(range(len(rows)))
    while todo:
        rank = todo.pop()
        row = rows[rank]
        i = pointer[rank]
        while i < len(row):
            action = row[i]
            ready = free_at[rank]
            blocked: Key | None = None
            for key in deps(action):
                hit = done.get(key)
                if hit is None:
                    blocked = key
                    break
                t = hit[1] + ((latency + (edge(key) if edge is not None else 0.0))
                              if hit[0] != rank else 0.0)
                if t > ready:
                    ready = t
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            if action.op is Op.REDUCE_GRAD:
                start = max(ready, link_free[rank])
                end = link_free[rank] = start + duration(action)
                starts[rank][i] = start
                ends[rank][i] = end
                free_at[rank] = ready
            else:
                end = ready + duration(action)
                starts[rank][i] = ready
                ends[rank][i] = end
                free_at[rank] = end
            key = key_of(action)
            done[key] = (rank, end)
            todo.extend(waiting.pop(key, ()))
            i += 1
        pointer[rank] = i
    stuck = {r: pointer[r] for r in range(len(rows)) if pointer[r] < len(rows[r])}
    if stuck:
        return Deadlock(
            {
                r: (i, tuple(k for k in deps(rows[r][i]) if k not in done))
                for r, i in stuck.items()
            }
        )
    return starts, ends


def deadlock(schedule: Schedule, stuck: dict[int, int], done: Container[Key]) -> Deadlock:
    deps = prerequisites(schedule)
    return Deadlock({r: (i, tuple(k for k in deps(schedule.actions[r][i]) if k not in done))
                     for r, i in stuck.items()})
