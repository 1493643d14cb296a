"""GPipe: every forward, then every backward (one flush per batch)."""

from __future__ import annotations

from schedules.ir import Action, Op, Schedule
from schedules.registry import register

__all__ = ["gpipe"]


@register("gpipe")
def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards; peak activations m on every rank.

    p=3, m=4, each rank's order (r: rank; cells `<stage><op><micro-batch>`)::

        r0  0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
        r1  1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
        r2  2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3

    Bubble (unit costs per stage): (p - 1) / (m + p - 1) of the makespan.
    """
    p, m = num_ranks, num_microbatches
    forward, backward = Op.F, Op.B
    rows = tuple(
        tuple(Action(r, forward, i) for i in range(m))
        + tuple(Action(r, backward, i) for i in range(m))
        for r in range(p)
    )
    return Schedule(p, p, m, rows, name="gpipe")
