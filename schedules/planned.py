"""A well-formed schedule's graph by action number, and the interpreter that runs it fast.

`plan` turns the graph `schedules.graph.prerequisites` states into action numbers, with each
action's prerequisites reduced to what it may wait for, and `execute_by_kind` runs that plan:
the result of `graph.execute` in a fraction of the time, for validate and simulate. Where a
schedule has no plan (malformed, or a program's syncs), `graph.execute` runs instead; a
property test holds the two to the same result on mutated schedules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container
from dataclasses import dataclass
from itertools import repeat
from operator import lt
from typing import cast

from schedules.graph import Deadlock, Key, deadlock, execute, key_of
from schedules.ir import Op, Schedule

__all__ = ["Plan", "execute_by_kind", "kind", "plan", "stage_op"]


_OPS = tuple(Op)
_CODE = {op: code for code, op in enumerate(_OPS)}
_WIDTH = len(_OPS)  # kinds per stage
_F, _B, _I, _W, _U, _SEND_F, _RECV_F, _SEND_B, _RECV_B = range(9)  # op codes
_SYNC = 9  # codes from here on are a program's syncs: `plan` leaves those to `execute`
assert _OPS[_F] is Op.F and _OPS[_RECV_B] is Op.RECV_B and _OPS[_SYNC] is Op.SEND_T


def kind(stage: int, op: Op) -> int:
    """An action's (stage, op) as one int, as in `Plan.kinds`."""
    return stage * _WIDTH + _CODE[op]


def stage_op(kind: int) -> tuple[int, Op]:
    """The (stage, op) of a kind."""
    stage, code = divmod(kind, _WIDTH)
    return stage, _OPS[code]


@dataclass(frozen=True, slots=True)
class Plan:
    """`prerequisites` by action number, reduced to what an action may have to wait for.

    Actions are numbered rank after rank. Each action's prerequisites on its own rank come
    before it (`plan` makes sure), so they have ended by the time the rank is free: what is
    left is at most one prerequisite on another rank.
    """

    offsets: tuple[int, ...]  # rank r's actions are numbers offsets[r] .. offsets[r + 1] - 1
    keys: list[int]  # per action, its key as an int: microbatch * span + kind
    span: int  # kinds per micro-batch: len(Op) * (num_stages + 1)
    kinds: list[int]  # per action, `kind(stage, op)`
    # Per action, the action on another rank it waits for: `len(kinds)` where no action has
    # its key (a slot that never runs), `len(kinds) + 1` where it has none (one run from the
    # start of time).
    waits: list[int]


_last: tuple[Schedule, Plan | None] | None = None  # the last schedule planned, and its plan


def plan(schedule: Schedule) -> Plan | None:
    """The `Plan` of `schedule`, or None where an action is on a rank that does not hold its
    stage (or a stage is out of range), two actions share a key, or a prerequisite on an
    action's own rank is missing or comes after it: `execute` handles those.

    The plan of the last schedule asked for is kept: validate then simulate make it once.
    """
    global _last
    last = _last
    if last is not None and last[0] is schedule:
        return last[1]
    found = _plan(schedule)
    _last = (schedule, found)
    return found


def _plan(schedule: Schedule) -> Plan | None:
    rows = schedule.actions
    if not all({a.stage for a in row} <= set(schedule.stages_of(rank))
               for rank, row in enumerate(rows)):
        return None
    # Keys as ints, micro-batch major: mb * span + kind. Stage n is no action's: a lookup
    # past the last stage finds nothing. k - 9 is the same op and micro-batch a stage down.
    span = _WIDTH * (schedule.num_stages + 1)
    code = _CODE
    keys = [a.microbatch * span + a.stage * _WIDTH + code[a.op] for row in rows for a in row]
    total = len(keys)
    number = dict(zip(keys, range(total), strict=True))  # int key -> action number
    if len(number) != total:
        return None
    kinds = [k % span for k in keys]
    kind_set = set(kinds)
    if any(kd % _WIDTH >= _SYNC for kd in kind_set):
        return None  # a program's syncs: `execute` runs it
    steps = _Steps(schedule, kind_set)
    get, local, remote = number.get, steps.local, steps.remote

    def producer(key: int) -> int:
        """The number of the gradient producer whose I has `key`: that I, else the B."""
        return get(key, total) if key in number else get(key - _I + _B, total)

    # Every prerequisite on an action's own rank comes before it.
    if [g for g, k in enumerate(keys) for add in local[k % span] if not get(k + add, total) < g]:
        return None
    if steps.gradients and [
            g for g in [g for g, kd in enumerate(kinds) if kd in steps.gradients]
            for add in steps.gradients[kinds[g]][0] if not producer(keys[g] + add) < g]:
        return None
    versions = {a.version for row in rows for a in row} - {None}
    versioned = bool(versions) and max(cast(set[int], versions)) >= 2
    if versioned or any(kd % _WIDTH == _U for kd in steps.kinds):
        waiters, wanted = _extra(schedule, number, kinds, versioned)
        if not all(map(lt, map(get, wanted, repeat(total)), waiters)):
            return None
    always = total + 1
    waits = [always if (add := remote[kd]) is None else get(k + add, total)
             for k, kd in zip(keys, kinds, strict=True)]
    for g in [g for g, kd in enumerate(kinds) if kd in steps.gradients] if steps.gradients else ():
        add = steps.gradients[kinds[g]][1]
        if add is not None:
            waits[g] = producer(keys[g] + add)
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + len(row))
    return Plan(tuple(offsets), keys, span, kinds, waits)


class _Steps:
    """Per kind of action, its prerequisites as offsets from its own int key: on its own rank
    (`local`), and on another rank (`remote`: at most one; None for none).

    `prerequisites` by kind, for an action on the rank that holds its stage. An input from an
    adjacent stage on another rank is the one prerequisite there: its producer, or in a lowered
    schedule its SEND (the RECV is on the waiter's rank). A gradient comes from I, else B: where
    the stage has only one of them, that one. Where it has both, which one depends on the
    micro-batch: `gradients` holds those prerequisites apart, by kind, as (offsets on the rank,
    offset on another rank or None), each to the I's key. Weight versions and updates depend on
    more than the kind: see `_extra`.
    """

    def __init__(self, schedule: Schedule, kinds: set[int]) -> None:
        n = schedule.num_stages
        rank_of = [schedule.rank_of(s) for s in range(n)]
        lowered = any(kd % _WIDTH >= _SEND_F for kd in kinds)
        self.kinds = kinds
        self.local: list[tuple[int, ...]] = [()] * (_WIDTH * (n + 1))
        self.remote: list[int | None] = [None] * (_WIDTH * (n + 1))
        self.gradients: dict[int, tuple[tuple[int, ...], int | None]] = {}
        for s in range(n):
            for c in range(_WIDTH):
                kd = s * _WIDTH + c
                here: tuple[int, ...] = ()
                there: int | None = None
                gradient: int | None = None  # to stage t's I, t = s + 1 or s; None: none
                if c == _F and s > 0:
                    if rank_of[s - 1] == rank_of[s]:
                        here = (-_WIDTH,)
                    elif lowered:  # RECV_F here, SEND_F a stage down
                        here, there = (_RECV_F,), -_WIDTH + _SEND_F
                    else:
                        there = -_WIDTH
                elif c in (_B, _I):
                    here = (_F - c,)  # its F
                    if s < n - 1 and lowered and rank_of[s + 1] != rank_of[s]:
                        here, there = (*here, _RECV_B - c), _WIDTH + _SEND_B - c  # SEND_B up
                    elif s < n - 1:
                        gradient = _WIDTH + _I - c
                elif c == _W:
                    here = (_I - _W,)
                elif c == _SEND_F:
                    here = (_F - _SEND_F,)
                elif c == _SEND_B:
                    gradient = _I - _SEND_B
                if gradient is not None:
                    t = (kd + gradient) // _WIDTH
                    on_rank = rank_of[t] == rank_of[s]
                    has_i, has_b = t * _WIDTH + _I in kinds, t * _WIDTH + _B in kinds
                    if has_i and has_b:
                        self.gradients[kd] = ((gradient,), None) if on_rank else ((), gradient)
                    else:
                        if not has_i:
                            gradient += _B - _I
                        if on_rank:
                            here += (gradient,)
                        else:
                            there = gradient
                self.local[kd], self.remote[kd] = here, there


def _extra(schedule: Schedule, number: Container[int], kinds: list[int],
           versioned: bool) -> tuple[list[int], list[int]]:
    """The prerequisites `_Steps` leaves out, as (waiters, int keys), all on the waiter's rank:
    U waits for every W (else B) of its stage and batch; where `versioned`, F with weight
    version v >= 2 waits for update v - 2 of its stage. Waiters are action numbers."""
    span = _WIDTH * (schedule.num_stages + 1)
    per_batch = schedule.num_microbatches
    actions = [a for row in schedule.actions for a in row]
    waiters: list[int] = []
    wanted: list[int] = []
    for g in [g for g, kd in enumerate(kinds) if kd % _WIDTH == _U]:
        a = actions[g]
        base = a.stage * _WIDTH
        first = a.microbatch * per_batch
        waiters += [g] * per_batch
        wanted += [m * span + base + (_W if m * span + base + _W in number else _B)
                   for m in range(first, first + per_batch)]
    if versioned:
        for g in [g for g, kd in enumerate(kinds) if kd % _WIDTH == _F]:
            a = actions[g]
            if a.version is not None and a.version >= 2:
                waiters.append(g)
                wanted.append((a.version - 2) * span + a.stage * _WIDTH + _U)
    return waiters, wanted


def execute_by_kind(
    schedule: Schedule,
    duration: Callable[[Op, int], float],
    latency: float = 0.0,
    *,
    edge: Callable[[Key], float] | None = None,
) -> tuple[list[list[float]], list[list[float]]] | Deadlock:
    """`execute` where an action's duration depends on its op and stage alone: the result of
    `execute(schedule, lambda a: duration(a.op, a.stage), latency)`, in a fraction of the time.

    `duration(op, stage)` is called once per pair, when the first action with it runs (it must
    not depend on when). Runs over the schedule's `Plan`; where it has none, or a duration is
    negative (prerequisites on the waiter's own rank could then end after it is free),
    `execute` runs.
    """
    def general() -> tuple[list[list[float]], list[list[float]]] | Deadlock:
        return execute(schedule, lambda a: duration(a.op, a.stage), latency, edge=edge)

    found = plan(schedule)
    if found is None:
        return general()
    offsets, kinds, waits = found.offsets, found.kinds, found.waits
    rows = schedule.actions
    total = offsets[-1]
    table: list[float | None] = [None] * (_WIDTH * (schedule.num_stages + 1))  # by kind
    starts = [0.0] * total
    ends: list[float | None] = [None] * (total + 2)  # None until the action ran
    ends[total + 1] = -math.inf  # waited for by actions that wait for nothing
    waiting: dict[int, list[int]] = {}
    pointer = [0] * len(rows)
    free_at = [0.0] * len(rows)
    todo = list(range(len(rows)))
    while todo:
        rank = todo.pop()
        base = offsets[rank]
        g, end, free = base + pointer[rank], offsets[rank + 1], free_at[rank]
        while g < end:
            w = waits[g]
            t = ends[w]
            if t is None:
                waiting.setdefault(w, []).append(rank)
                break
            t += latency
            ready = t if t > free else free
            kd = kinds[g]
            d = table[kd]
            if d is None:
                d = table[kd] = duration(_OPS[kd % _WIDTH], kd // _WIDTH)
                if d < 0:
                    return general()
            free = ready + d
            starts[g] = ready
            ends[g] = free
            if waiting:
                woken = waiting.pop(g, None)
                if woken is not None:
                    todo.extend(woken)
            g += 1
        pointer[rank] = g - base
        free_at[rank] = free
    stuck = {r: pointer[r] for r in range(len(rows)) if pointer[r] < len(rows[r])}
    if stuck:
        ran = {key_of(a) for r, row in enumerate(rows) for a in row[:pointer[r]]}
        return deadlock(schedule, stuck, ran)
    ran_ends = cast(list[float], ends)
    return ([starts[offsets[r]:offsets[r + 1]] for r in range(len(rows))],
            [ran_ends[offsets[r]:offsets[r + 1]] for r in range(len(rows))])
