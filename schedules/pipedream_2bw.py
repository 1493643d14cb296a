"""PipeDream-2BW: 1F1B across batch boundaries with no flush, two weight versions per stage."""

from __future__ import annotations

from schedules.ir import Action, Op, Schedule
from schedules.one_f_one_b import one_f_one_b_order
from schedules.registry import register

__all__ = ["pipedream_2bw"]


@register("2bw", batches_option="num_batches")
def pipedream_2bw(num_ranks: int, num_microbatches: int, num_batches: int = 1) -> Schedule:
    """1F1B over all `num_batches * num_microbatches` micro-batches, with an update per batch.

    Every F/B carries the weight version it computes with: batch b uses version b, where versions
    0 and 1 are the previous and the current weights when the schedule starts, and the update
    U(s, b) that follows batch b's last backward on stage s makes version b + 2 from version
    b + 1 and batch b's gradients. Hence W(t+1) = W(t) - lr * grad f(W(t-1)), with at most two
    versions alive. Version b + 2 must exist before batch b + 2 starts on a stage, which 1F1B's
    warm-up of min(p - r - 1, m) forwards guarantees. p=3, m=2, two batches, each rank's
    order (`vK`: weight version K; `sUb`: update of stage s after batch b)::

        r0  0F0v0 0F1v0 0F2v1 0B0v0 0F3v1 0B1v0 0U0 0B2v1 0B3v1 0U1
        r1  1F0v0 1F1v0 1B0v0 1F2v1 1B1v0 1U0 1F3v1 1B2v1 1B3v1 1U1
        r2  2F0v0 2B0v0 2F1v0 2B1v0 2U0 2F2v1 2B2v1 2F3v1 2B3v1 2U1
    """
    p, m, n = num_ranks, num_microbatches, num_batches
    rows = []
    for r in range(p):
        row: list[Action] = []
        for op, i in one_f_one_b_order(min(p - r - 1, m), n * m):
            batch = i // m
            row.append(Action(r, op, i, batch))
            if op is Op.B and i % m == m - 1:
                row.append(Action(r, Op.U, batch))
        rows.append(tuple(row))
    return Schedule(p, p, m, tuple(rows), num_batches=n, name="2bw")
