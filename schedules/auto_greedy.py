"""The list-scheduling heuristic behind `schedule="auto"`: F, I and W placed by simulated time.

One stage per rank (stage r on rank r). Time runs event by event under the simulator's cost
model (per-stage durations, `comm` on every dependency between ranks). Whenever a rank is
free it starts, in this order of preference (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024, section 3's heuristic):

1. its next I, if the gradient has arrived: the critical path runs through the I's;
2. its next F, if the input has arrived and fewer than its cap of micro-batches are alive
   (F done, W not yet: what `schedules.simulate` counts as activations held);
3. a deferred W, to fill the time until one of those can start. `Policy.fill` says when:
   "idle" whenever nothing else can start, "fit" only when the W ends before the next input
   can arrive (or when the cap blocks the next F), "eager" right after its own I (the split
   backward run as one B).

Each rank runs its F's, its I's and its W's in micro-batch order; the caps (per rank) set how
deep each warm-up goes. `auto` tries several policies and keeps the best simulated one.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from schedules.ir import Action, Op, Schedule, ScheduleError
from schedules.simulate import Costs

__all__ = ["FILLS", "Policy", "greedy"]

FILLS = ("idle", "fit", "eager")


@dataclass(frozen=True, slots=True)
class Policy:
    """One setting of the heuristic: per rank, the most micro-batches alive (`caps`), and when
    to run a W (`fill`, one of `FILLS`)."""

    caps: tuple[int, ...]
    fill: str

    def __post_init__(self) -> None:
        if self.fill not in FILLS:
            raise ScheduleError(f"Policy.fill must be one of {FILLS} (got {self.fill!r})")
        if any(c < 1 for c in self.caps):
            raise ScheduleError(f"Policy.caps must be >= 1 on every rank (got {self.caps}): a "
                                f"rank that may hold no micro-batch can run no forward")

    def label(self) -> str:
        return f"greedy(caps={'/'.join(map(str, self.caps))}, fill={self.fill})"


def greedy(num_ranks: int, num_microbatches: int, costs: Costs, policy: Policy) -> Schedule:
    """The schedule the heuristic places under `policy` (one stage per rank, loop placement).

    Actions start at event times only: the end of an action, or the arrival of its result on
    the next rank (end + comm). At each event every free rank, in rank order, starts what the
    rules above choose; ranks are tried again until none starts anything, then time moves on.
    """
    p, m = num_ranks, num_microbatches
    if len(policy.caps) != p:
        raise ScheduleError(f"Policy.caps holds {len(policy.caps)} caps for {p} ranks; give "
                            f"one per rank")
    comm = costs.comm
    forward, input_grad, weight_grad = Op.F, Op.I, Op.W
    dur = {(op, r): [costs.of_action(Action(r, op, k)) for k in range(m)]
           for op in (forward, input_grad, weight_grad) for r in range(p)}
    f_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    i_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    rows: list[list[Action]] = [[] for _ in range(p)]
    free = [0.0] * p
    next_f, next_i, alive = [0] * p, [0] * p, [0] * p
    deferred: list[deque[int]] = [deque() for _ in range(p)]
    left = 3 * p * m
    now = 0.0
    events: list[float] = []  # times at which a rank is free or an input arrives

    def arrival(r: int, op: Op) -> float | None:
        """When the input of rank r's next `op` is there; None while it is not yet placed."""
        if op is forward:
            k = next_f[r]
            if r == 0:
                return 0.0
            end = f_end[r - 1][k]
            return None if end is None else end + comm
        k = next_i[r]
        if r == p - 1:
            return f_end[r][k]  # its own forward: same rank, no transfer
        end = i_end[r + 1][k]
        return None if end is None else end + comm

    def earliest(r: int, op: Op) -> float:
        """A lower bound on that arrival where it is not placed yet: the upstream rank's
        action cannot start before that rank is free (or now)."""
        known = arrival(r, op)
        if known is not None:
            return known
        src = r - 1 if op is forward else r + 1
        k = next_f[r] if op is forward else next_i[r]
        return max(free[src], now) + dur[(op, src)][k] + comm

    def choose(r: int) -> Action | None:
        can_i = next_i[r] < next_f[r]
        can_f = next_f[r] < m and alive[r] < policy.caps[r]
        if can_i:
            ready = arrival(r, input_grad)
            if ready is not None and ready <= now:
                return Action(r, input_grad, next_i[r])
        if can_f:
            ready = arrival(r, forward)
            if ready is not None and ready <= now:
                return Action(r, forward, next_f[r])
        if not deferred[r]:
            return None
        w = Action(r, weight_grad, deferred[r][0])
        if policy.fill != "fit":
            return w  # "eager" W's never wait (its I queued it alone); "idle": fill any gap
        blocked = next_f[r] < m and alive[r] >= policy.caps[r]
        if blocked or (not can_i and next_f[r] >= m):
            return w  # the W frees memory for the next F, or nothing else is left to run
        gap = min(earliest(r, op) for op, can in ((input_grad, can_i), (forward, can_f)) if can)
        return w if now + dur[(weight_grad, r)][w.microbatch] <= gap else None

    while left:
        started = True
        while started:  # every free rank starts what it can; zero-length actions end at once
            started = False
            for r in range(p):
                if free[r] > now:
                    continue
                action = choose(r)
                if action is None:
                    continue
                k = action.microbatch
                end = now + dur[(action.op, r)][k]
                if action.op is forward:
                    f_end[r][k], next_f[r] = end, k + 1
                    alive[r] += 1
                elif action.op is input_grad:
                    i_end[r][k], next_i[r] = end, k + 1
                    deferred[r].append(k)
                else:
                    deferred[r].popleft()
                    alive[r] -= 1
                rows[r].append(action)
                free[r] = end
                left -= 1
                started = True
                heapq.heappush(events, end)
                heapq.heappush(events, end + comm)  # its result on the next rank
                if policy.fill == "eager" and action.op is input_grad:
                    # Its W follows at once, before any other choice: the backward as one B.
                    rows[r].append(Action(r, weight_grad, deferred[r].pop()))
                    alive[r] -= 1
                    end += dur[(weight_grad, r)][k]
                    free[r] = end
                    left -= 1
                    heapq.heappush(events, end)
        while events and events[0] <= now:
            heapq.heappop(events)
        if left and not events:
            raise ScheduleError(f"the auto heuristic is stuck at time {now} with p={p}, "
                                f"m={m}: no rank can start and nothing is running")
        if events:
            now = heapq.heappop(events)
    return Schedule(p, p, m, tuple(tuple(row) for row in rows), name="auto")

