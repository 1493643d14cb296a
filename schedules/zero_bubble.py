"""Zero-bubble schedules with one stage per rank (Qi et al., ICLR 2024): ZB-H1, ZB-H2.

The backward is split into I (input gradient, sent upstream at once) and W (weight gradient,
needed by nobody downstream), and the W's fill the bubbles 1F1B leaves. A micro-batch's
activations stay alive from its F until its W, so deferring a W costs memory: each schedule
here is a trade between the two.
"""

from __future__ import annotations

from collections import deque

from schedules.ir import Action, Op, Schedule
from schedules.registry import register

__all__ = ["zb_h1", "zb_h1_tight", "zb_h2"]


@register("zb-h1")
def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """The paper's ZB-H1: 1F1B's order with B split into I and W, rank r deferring r W's.

    Rank r warms up with min(m, p - 1 - r) forwards, then runs F, I per micro-batch, adding the
    W of micro-batch k - r after the I of micro-batch k: I is half of B, so gradients climb
    the pipeline twice as fast as in 1F1B, and the r W's held back on rank r fill the slots
    where it would wait for them. Unit costs F = I = W = 1: makespan 3m + p - 1 for m >= p
    (the least possible: the last rank cannot start before p - 1 and has 3m of work), and
    max(3m + p - 1, 2m + 2p - 1) for any m. Every rank holds at most min(m, p) micro-batches
    (from F to W), 1F1B's peak over ranks. This is torch's `ScheduleInterleavedZeroBubble`
    with one stage per rank. p=3, m=4, each rank's order (r: rank; `<stage><op><micro-batch>`)::

        r0  0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
        r1  1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
        r2  2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3
    """
    p, m = num_ranks, num_microbatches
    forward, input_grad, weight_grad = Op.F, Op.I, Op.W
    rows = []
    for r in range(p):
        warmup = min(m, p - 1 - r)
        row = [Action(r, forward, i) for i in range(warmup)]
        for k in range(m):
            if warmup + k < m:
                row.append(Action(r, forward, warmup + k))
            row.append(Action(r, input_grad, k))
            if k >= r:
                row.append(Action(r, weight_grad, k - r))
        row += [Action(r, weight_grad, k) for k in range(max(0, m - r), m)]
        rows.append(tuple(row))
    return Schedule(p, p, m, tuple(rows), name="zb-h1")


@register("zb-h2")
def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    """The paper's ZB-H2: up to 2p - 1 micro-batches alive on every rank, no bubble in a rank's
    own span.

    The same greedy as `zb-h1-tight` with a cap of min(m, 2p - 1) alive micro-batches on
    every rank: rank r fills its warm-up with 2(p - r) - 1 forwards (until its first gradient
    arrives) and, at the end, the W's it deferred fill its cool-down, so for m >= 2p - 1 every
    rank computes without a gap from its first action to its last (3m at unit costs: the
    paper's parallelogram). In one step with a flush the makespan is still 3m + p - 1 (the
    last rank starts at p - 1); the gain is that the next step's forwards can start on rank 0
    while later ranks finish, where a runtime does not flush between steps, and that the long
    warm-up hides transfer latency (p=4, m=8, comm=0.5: makespan 28.5, ZB-H1's 33). p=3, m=4::

        r0  0F0 0F1 0F2 0F3 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3
        r1  1F0 1F1 1F2 1I0 1F3 1I1 1W0 1I2 1W1 1I3 1W2 1W3
        r2  2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2W0 2W1 2W2 2W3
    """
    p, m = num_ranks, num_microbatches
    return _greedy(p, m, [min(m, 2 * p - 1)] * p, "zb-h2")


@register("zb-h1-tight")
def zb_h1_tight(num_ranks: int, num_microbatches: int) -> Schedule:
    """Zero-bubble under 1F1B's per-rank memory: at most min(m, p - r) alive on rank r.

    A greedy list schedule over unit-time F, I and W: each tick every free rank runs the first
    of its next I whose gradient has arrived; its next F whose input has arrived, if fewer
    than the cap are alive (F done, W not yet); its oldest deferred W. Unit costs, m >= p:
    makespan 3m + 2(p - 1), between 1F1B's 3(m + p - 1) and ZB-H1's 3m + p - 1, with the
    total memory of 1F1B (p(p + 1)/2 micro-batches over all ranks, against ZB-H1's p^2).
    p=3, m=4::

        r0  0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
        r1  1F0 1F1 1I0 1W0 1F2 1I1 1W1 1F3 1I2 1W2 1I3 1W3
        r2  2F0 2I0 2W0 2F1 2I1 2W1 2F2 2I2 2W2 2F3 2I3 2W3
    """
    p, m = num_ranks, num_microbatches
    return _greedy(p, m, [min(m, p - r) for r in range(p)], "zb-h1-tight")


def _greedy(p: int, m: int, caps: list[int], name: str) -> Schedule:
    """Tick by tick at unit costs, each rank runs I if it can, else F under its cap, else W."""
    forward, input_grad, weight_grad = Op.F, Op.I, Op.W
    never = 1 << 62
    # Per rank and micro-batch, the tick its F (its I) finished; `never` until then.
    f_done = [[never] * m for _ in range(p)]
    i_done = [[never] * m for _ in range(p)]
    rows: list[list[Action]] = [[] for _ in range(p)]
    next_f, next_i, alive = [0] * p, [0] * p, [0] * p
    deferred: list[deque[int]] = [deque() for _ in range(p)]
    left = 3 * m * p  # actions still to place: F, I and W of every micro-batch on every rank
    tick = 0
    while left:
        finished: list[tuple[list[int], int]] = []
        for r in range(p):
            i, f = next_i[r], next_f[r]
            if i < f and (r == p - 1 or i_done[r + 1][i] <= tick):
                action, next_i[r] = Action(r, input_grad, i), i + 1
                deferred[r].append(i)
                finished.append((i_done[r], i))
            elif f < m and alive[r] < caps[r] and (r == 0 or f_done[r - 1][f] <= tick):
                action, next_f[r] = Action(r, forward, f), f + 1
                alive[r] += 1
                finished.append((f_done[r], f))
            elif deferred[r]:
                action = Action(r, weight_grad, deferred[r].popleft())
                alive[r] -= 1
            else:
                continue
            rows[r].append(action)
            left -= 1
        for ticks, mb in finished:  # visible to other ranks from the next tick on
            ticks[mb] = tick + 1
        tick += 1
    return Schedule(p, p, m, tuple(tuple(row) for row in rows), name=name)
