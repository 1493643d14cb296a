"""The least makespan of a one-stage-per-rank F/I/W schedule, by branch and bound (small p x m).

What `schedules.auto`'s heuristic is measured against. The search is exact over schedules that
run, on every rank, their F's, their I's and their W's each in micro-batch order (any
interleaving of the three), within a memory limit, under the simulator's cost model: each
action starts as soon as its rank is free and its input has arrived. Every such schedule is
met once: actions are placed in order of (start, rank), and an action may only be placed
once everything it waits for is. A branch ends when a lower bound (for each rank: when it can
next start, plus all the work it has left) reaches the best makespan found so far, which
starts at the heuristic's. States seen before (same progress, same times) are not searched
again. Costs must be positive, so that every action starts after what it waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schedules.ir import Action, Op, Schedule, ScheduleError
from schedules.simulate import Costs

__all__ = ["Optimum", "optimum"]

_F, _I, _W = 0, 1, 2
_OPS = (Op.F, Op.I, Op.W)


@dataclass(frozen=True, slots=True)
class Optimum:
    """The least makespan, a schedule that reaches it, and how many search nodes it took."""

    makespan: float
    schedule: Schedule
    nodes: int


def optimum(num_ranks: int, num_microbatches: int, costs: Costs,
            memory_limit: int | Sequence[int] | None = None, *,
            upper: tuple[float, Schedule] | None = None,
            max_nodes: int = 2_000_000) -> Optimum:
    """The least makespan over the schedules the module describes. `upper`: a known schedule
    and its makespan to start from (the heuristic's); the search only looks for better ones.
    Raises `ScheduleError` past `max_nodes` nodes (the search is exponential: p x m small)."""
    p, m = num_ranks, num_microbatches
    dur = [[costs.of(op, r) for op in _OPS] for r in range(p)]
    if costs.microbatch or any(d <= 0 for row in dur for d in row):
        raise ScheduleError(f"auto_exact needs positive F, I and W costs, the same for every "
                            f"micro-batch (got {dur} per rank, microbatch={costs.microbatch})")
    if memory_limit is None:
        caps = [m] * p
    elif isinstance(memory_limit, int):
        caps = [memory_limit] * p
    else:
        caps = list(memory_limit)
    if len(caps) != p or min(caps) < 1:
        raise ScheduleError(f"auto_exact: memory_limit must be >= 1 for each of the {p} ranks "
                            f"(got {memory_limit!r})")
    comm = costs.comm
    # ends[r][op][k]: when rank r's op of micro-batch k ended (None: not placed yet).
    ends: list[list[list[float | None]]] = [[[None] * m for _ in _OPS] for _ in range(p)]
    count = [[0, 0, 0] for _ in range(p)]
    free = [0.0] * p
    left_work = [m * sum(dur[r]) for r in range(p)]
    order: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    best_span = float("inf") if upper is None else upper[0]
    best_rows: tuple[tuple[Action, ...], ...] | None = (
        None if upper is None else upper[1].actions)
    seen: set[tuple[object, ...]] = set()
    nodes = 0

    def ready(r: int, op: int, k: int) -> float | None:
        """When rank r's `op` of micro-batch k may start as far as its input goes."""
        if op == _F:
            if r == 0:
                return 0.0
            e = ends[r - 1][_F][k]
            return None if e is None else e + comm
        if op == _I:
            if r == p - 1:
                return ends[r][_F][k]
            e = ends[r + 1][_I][k]
            return None if e is None else e + comm
        return ends[r][_I][k]

    def options(r: int) -> list[tuple[float, int]]:
        nf, ni, nw = count[r]
        out = []
        for op, allowed, k in ((_I, ni < nf, ni), (_F, nf < m and nf - nw < caps[r], nf),
                               (_W, nw < ni, nw)):
            if allowed:
                t = ready(r, op, k)
                if t is not None:
                    out.append((max(t, free[r]), op))
        return out

    def state() -> tuple[object, ...]:
        # What the rest of the search depends on: progress, when each rank is free, and the
        # ends later actions still wait for (F's the next rank has not run, I's the previous
        # rank has not run).
        pending = tuple(
            (tuple(ends[r][_F][count[r + 1][_F]:count[r][_F]]) if r + 1 < p else (),
             tuple(ends[r][_I][count[r - 1][_I]:count[r][_I]]) if r > 0 else ())
            for r in range(p))
        return tuple(map(tuple, count)), tuple(free), pending

    def search(frontier: tuple[float, int], span: float) -> None:
        nonlocal best_span, best_rows, nodes
        nodes += 1
        if nodes > max_nodes:
            raise ScheduleError(f"auto_exact: more than {max_nodes} nodes at p={p}, m={m}; "
                                f"the exact search is for small p x m")
        if all(w <= 0 for w in left_work):
            if span < best_span:
                best_span = span
                best_rows = tuple(tuple(Action(r, _OPS[op], k) for op, k in order[r])
                                  for r in range(p))
            return
        bound = max(max(free[r], frontier[0]) + left_work[r] for r in range(p) if left_work[r])
        if max(bound, span) >= best_span:
            return
        key = (frontier, *state())
        if key in seen:
            return
        seen.add(key)
        for r in range(p):
            for start, op in options(r):
                if (start, r) < frontier:
                    continue  # placed in (start, rank) order: another branch has this one
                k = count[r][op]
                d = dur[r][op]
                end = start + d
                saved = free[r]
                ends[r][op][k], free[r] = end, end
                count[r][op] += 1
                left_work[r] -= d
                order[r].append((op, k))
                search((start, r), max(span, end))
                order[r].pop()
                left_work[r] += d
                count[r][op] -= 1
                ends[r][op][k], free[r] = None, saved

    search((0.0, -1), 0.0)
    if best_rows is None:
        raise ScheduleError(f"auto_exact found no schedule at p={p}, m={m} within the memory "
                            f"limit {caps}")
    return Optimum(best_span, Schedule(p, p, m, best_rows, name="auto-exact"), nodes)
