"""Zero-bubble H1: backward split into I (input grad) and W (weight grad); W fills bubbles."""

from __future__ import annotations

from collections import deque

from schedules.ir import Action, Op, Schedule
from schedules.registry import register

__all__ = ["zb_h1"]


@register("zb-h1")
def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """Greedy list schedule over unit-time F, I and W with 1F1B's memory bound.

    Each tick, every free rank runs the first of: the next I whose gradient has arrived; the next
    F whose input has arrived, if fewer than min(m, p - r) micro-batches are alive on the rank
    (alive: F done, W not yet: the same bound as 1F1B); the oldest deferred W. Because I is
    cheaper than B, gradients travel up the pipeline faster than in 1F1B, and the deferred W's
    fill what would have been the cool-down bubble. Under unit costs and m >= p the makespan
    is 3m + 2(p - 1), against 1F1B's 3(m + p - 1). p=3, m=4, each rank's order::

        r0  0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
        r1  1F0 1F1 1I0 1W0 1F2 1I1 1W1 1F3 1I2 1W2 1I3 1W3
        r2  2F0 2I0 2W0 2F1 2I1 2W1 2F2 2I2 2W2 2F3 2I3 2W3
    """
    p, m = num_ranks, num_microbatches
    cap = [min(m, p - r) for r in range(p)]
    done: dict[tuple[int, Op, int], int] = {}  # (rank, op, micro-batch) -> tick it finished
    rows: list[list[Action]] = [[] for _ in range(p)]
    next_f, next_i, alive = [0] * p, [0] * p, [0] * p
    deferred: list[deque[int]] = [deque() for _ in range(p)]
    never = 1 << 62
    tick = 0
    while any(len(row) < 3 * m for row in rows):
        finished = []
        for r in range(p):
            i, f = next_i[r], next_f[r]
            if i < f and (r == p - 1 or done.get((r + 1, Op.I, i), never) <= tick):
                action, next_i[r] = Action(r, Op.I, i), i + 1
                deferred[r].append(i)
            elif f < m and alive[r] < cap[r] and (r == 0 or done.get((r - 1, Op.F, f),
                                                                      never) <= tick):
                action, next_f[r] = Action(r, Op.F, f), f + 1
                alive[r] += 1
            elif deferred[r]:
                action = Action(r, Op.W, deferred[r].popleft())
                alive[r] -= 1
            else:
                continue
            rows[r].append(action)
            finished.append((r, action))
        for r, action in finished:  # visible to other ranks from the next tick on
            done[(r, action.op, action.microbatch)] = tick + 1
        tick += 1
    return Schedule(p, p, m, tuple(tuple(row) for row in rows), name="zb-h1")
