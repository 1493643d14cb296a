"""1F1B (PipeDream-Flush): after a short warm-up each rank alternates one forward, one backward."""

from __future__ import annotations

from schedules.ir import Action, Op, Schedule
from schedules.registry import register

__all__ = ["one_f_one_b", "one_f_one_b_order"]


def one_f_one_b_order(warmup: int, num_microbatches: int) -> list[tuple[Op, int]]:
    """`warmup` forwards, then (F, B) pairs, then the remaining backwards, in micro-batch order."""
    m, forward, backward = num_microbatches, Op.F, Op.B
    warmup = min(warmup, m)
    order = [(forward, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(forward, warmup + i), (backward, i)]
    order += [(backward, i) for i in range(m - warmup, m)]
    return order


@register("1f1b")
def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Rank r warms up with min(p - r - 1, m) forwards, then alternates F and B.

    Same bubble as GPipe, (p - 1) / (m + p - 1), but rank r holds at most min(m, p - r)
    micro-batches' activations instead of m. Any m >= 1 works (m < p simply shortens the
    steady state). p=3, m=4, each rank's order (r: rank; cells `<stage><op><micro-batch>`)::

        r0  0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
        r1  1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
        r2  2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
    """
    p, m = num_ranks, num_microbatches
    rows = tuple(
        tuple(Action(r, op, i) for op, i in one_f_one_b_order(p - r - 1, m)) for r in range(p)
    )
    return Schedule(p, p, m, rows, name="1f1b")
