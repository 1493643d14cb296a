"""A schedule's dependency graph by action number, built once per schedule and kept for timing.

`schedules.graph.execute` states the graph by key and walks it afresh at every call: the
simulator with per micro-batch costs (the tokens cut times three run orders every training
step) rebuilt the same graph step after step. Everything here depends on the schedule alone:
`compile_graph` numbers the actions, turns each prerequisite into a number, drops those the
timing can never see, and finds an order to run them in once; `run` is the timing pass under
one set of durations. Its result is `execute`'s exactly (a property test holds them equal):
where the order does not exist (a deadlock, or two actions with one key), `run` answers None
and the caller runs `execute`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from schedules import graph as _graph
from schedules.graph import Key, key_of
from schedules.ir import Action, Op, Schedule

__all__ = ["KEPT", "Graph", "compile_graph", "graph_of", "kept", "run"]

KEPT = 16  # schedules whose graphs are kept: a Pipe times one program per chunk count


@dataclass(frozen=True, slots=True)
class Graph:
    """A schedule's actions numbered rank after rank, and what each must wait for.

    `steps` is the order the timing runs them in (each rank's in its order, every action after
    its prerequisites), one `(number, rank, waits, background)` per action: `waits` holds
    `(number, slot)` pairs: the prerequisite's end plus the slot's cost (see `edges`) is
    when it lets the action start. None where the schedule has no such order (see the module
    docstring).
    """

    offsets: tuple[int, ...]  # rank r's actions are numbers offsets[r] .. offsets[r + 1] - 1
    actions: tuple[Action, ...]  # by number
    kinds: tuple[tuple[Op, int], ...]  # each (op, stage) the actions have, once
    kind_of: tuple[int, ...]  # per action, its (op, stage)'s index in `kinds`
    steps: tuple[tuple[int, int, tuple[tuple[int, int], ...], bool], ...] | None
    # The keys waited on across ranks (their transfer may cost): slot s > 0 is edges[s - 1].
    # Slot 0 is a wait on the rank's own background reduction, which costs nothing more.
    edges: tuple[Key, ...]


def compile_graph(schedule: Schedule) -> Graph:
    """The `Graph` of `schedule`, built from `schedules.graph.prerequisites`."""
    rows = schedule.actions
    actions = tuple(a for row in rows for a in row)
    offsets = [0]
    ranks: list[int] = []
    for r, row in enumerate(rows):
        offsets.append(offsets[-1] + len(row))
        ranks += [r] * len(row)
    index: dict[tuple[Op, int], int] = {}
    kind_of = tuple(index.setdefault((a.op, a.stage), len(index)) for a in actions)
    shape = (tuple(offsets), actions, tuple(index), kind_of)
    number = {key_of(a): g for g, a in enumerate(actions)}
    if len(number) != len(actions):  # two actions with one key: `execute` decides
        return Graph(*shape, None, ())
    deps = _graph.prerequisites(schedule)
    missing = len(actions)  # a key no action has: whoever waits for it never runs
    waits: list[list[int]] = [[number.get(key, missing) for key in deps(a)] for a in actions]
    order = _order(offsets, waits)
    if order is None:
        return Graph(*shape, None, ())
    slots: dict[Key, int] = {}
    steps = []
    for g in order:
        r = ranks[g]
        kept = []
        for p in waits[g]:
            if ranks[p] != r:
                kept.append((p, slots.setdefault(key_of(actions[p]), len(slots) + 1)))
            elif actions[p].op is Op.REDUCE_GRAD:
                # A reduction ends after its rank is free again; any other action before
                # this one on its rank has ended by then (durations are never negative).
                kept.append((p, 0))
        steps.append((g, r, tuple(kept), actions[g].op is Op.REDUCE_GRAD))
    return Graph(*shape, tuple(steps), tuple(slots))


def _order(offsets: Sequence[int], waits: list[list[int]]) -> list[int] | None:
    """Every action once, each rank's in order and each after what it waits for (as `execute`
    runs them), or None where some rank stops for good."""
    total = offsets[-1]
    done = [False] * (total + 1)  # done[total]: a missing key, never done
    waiting: dict[int, list[int]] = {}
    pointer = list(offsets[:-1])
    order: list[int] = []
    todo = list(range(len(offsets) - 1))
    while todo:
        rank = todo.pop()
        g, end = pointer[rank], offsets[rank + 1]
        while g < end:
            blocked = next((p for p in waits[g] if not done[p]), None)
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            done[g] = True
            order.append(g)
            todo.extend(waiting.pop(g, ()))
            g += 1
        pointer[rank] = g
    return order if len(order) == total else None


def run(graph: Graph, durations: Sequence[float], latency: float = 0.0, *,
        edge: Callable[[Key], float] | None = None
        ) -> tuple[list[list[float]], list[list[float]]] | None:
    """Per-rank start and end times of `graph`'s actions under `durations` (by number): the
    result of `schedules.graph.execute` with those durations. None where the graph has no
    order or a duration is negative: run `execute` for its answer (or its error)."""
    steps = graph.steps
    if steps is None or any(map((0.0).__gt__, durations)):
        return None
    # A wait across ranks costs the latency plus its transfer, as `execute` adds them.
    add = [0.0] + [latency + (edge(key) if edge is not None else 0.0) for key in graph.edges]
    total = graph.offsets[-1]
    starts = [0.0] * total
    ends = [0.0] * total
    num_ranks = len(graph.offsets) - 1
    free = [0.0] * num_ranks
    link = [0.0] * num_ranks  # when each rank's background reductions are done
    for g, r, waits, background in steps:
        ready = free[r]
        for p, slot in waits:
            t = ends[p] + add[slot]
            if t > ready:
                ready = t
        if background:  # a REDUCE_GRAD: it takes none of its rank's time (see `execute`)
            start = max(ready, link[r])
            starts[g] = start
            ends[g] = link[r] = start + durations[g]
            free[r] = ready
        else:
            starts[g] = ready
            ends[g] = free[r] = ready + durations[g]
    offsets = graph.offsets
    return ([starts[offsets[r]:offsets[r + 1]] for r in range(num_ranks)],
            [ends[offsets[r]:offsets[r + 1]] for r in range(num_ranks)])


# Keyed by identity and holding the schedule itself: while its graph is kept, no other
# object can take its id. Least recently used out first.
_kept: OrderedDict[int, tuple[Schedule, Graph]] = OrderedDict()
_lock = threading.Lock()


def graph_of(schedule: Schedule) -> Graph:
    """The `Graph` of `schedule`, built at its first call and kept for the `KEPT` schedules
    last asked for."""
    with _lock:
        hit = _kept.get(id(schedule))
        if hit is not None and hit[0] is schedule:
            _kept.move_to_end(id(schedule))
            return hit[1]
    found = compile_graph(schedule)  # outside the lock: another thread may time meanwhile
    with _lock:
        _kept[id(schedule)] = (schedule, found)
        _kept.move_to_end(id(schedule))
        while len(_kept) > KEPT:
            _kept.popitem(last=False)
    return found


def kept() -> tuple[Schedule, ...]:
    """The schedules whose graphs are kept, least recently used first."""
    with _lock:
        return tuple(s for s, _ in _kept.values())
