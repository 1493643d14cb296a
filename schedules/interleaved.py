"""Interleaved 1F1B: v stages per rank (looped placement), depth-first order as in Megatron-LM."""

from __future__ import annotations

from schedules.ir import Action, Op, Schedule, ScheduleError
from schedules.registry import register

__all__ = ["interleaved"]


def _rounds(num_ranks: int, num_microbatches: int) -> list[range]:
    """Micro-batches in max(1, m // p) rounds of near-equal size, the larger first.

    A round runs through all local stages before the next round starts (depth-first). Rounds
    are never shorter than p unless m < p: a short round would leave the last rank waiting for
    a forward that the first rank has queued behind a backward, a deadlock.
    """
    count = max(1, num_microbatches // num_ranks)
    base, extra = divmod(num_microbatches, count)
    rounds, start = [], 0
    for k in range(count):
        size = base + (1 if k < extra else 0)
        rounds.append(range(start, start + size))
        start += size
    return rounds


@register("interleaved", stages_per_rank=2, stages_option="stages_per_rank")
def interleaved(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Each rank holds v = `stages_per_rank` stages r, r + p, ..., and runs 1F1B over them.

    Forwards go round by round (p micro-batches per round): round 0 through local stage 0, then
    round 0 through local stage 1, ...; backwards likewise with the local stages reversed. Rank r
    warms up with (v - 1) * p + 2 * (p - r - 1) forwards, then alternates one forward and one
    backward. With per-stage costs F and B (each stage is 1/v of the model) and m a multiple of
    p, the bubble is (p - 1) / (v * m + p - 1): v times smaller than 1F1B's. Any m >= 1 works
    (m not a multiple of p adds a little bubble at the ragged round).
    p=3, m=4, v=2, each rank's order (stage s lives on rank s mod 3; one round of 4)::

        r0  0F0 0F1 0F2 0F3 3F0 3F1 3F2 3F3 3B0 3B1 3B2 3B3 0B0 0B1 0B2 0B3
        r1  1F0 1F1 1F2 1F3 4F0 4F1 4F2 4B0 4F3 4B1 4B2 4B3 1B0 1B1 1B2 1B3
        r2  2F0 2F1 2F2 2F3 5F0 5B0 5F1 5B1 5F2 5B2 5F3 5B3 2B0 2B1 2B2 2B3
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if v < 2:
        raise ScheduleError(f"interleaved needs stages_per_rank >= 2 (got {v}); "
                            f"use '1f1b' for one stage per rank")
    rounds = _rounds(p, m)
    forward, backward = Op.F, Op.B
    rows = []
    for r in range(p):
        forwards = [Action(c * p + r, forward, i) for rnd in rounds for c in range(v) for i in rnd]
        backwards = [Action(c * p + r, backward, i)
                     for rnd in rounds for c in reversed(range(v)) for i in rnd]
        warmup = min((v - 1) * len(rounds[0]) + 2 * (p - r - 1), v * m)
        order = forwards[:warmup]
        for k in range(v * m - warmup):
            order += [forwards[warmup + k], backwards[k]]
        order += backwards[v * m - warmup:]
        rows.append(tuple(order))
    return Schedule(p, v * p, m, tuple(rows), name="interleaved")
