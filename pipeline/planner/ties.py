"""Near ties: the candidates within `NEAR` of the fastest predicted step, and the one chosen.

A predicted step comes from a profile that moves from run to run by a few percent (see
docs/planning.md for the measured spread), and candidates that differ in little more than
their names (zb-v or interleaved at two stages per rank, checkpoint 'except_last' or 'always'
where the last stage is small) predict steps closer than that. Taking the fastest among them
would pick by the profile's noise, a different plan each run. So every candidate within `NEAR`
of the fastest is a *near tie*, and among them the simplest is chosen, by a fixed order:
fewer stages per rank (fewer messages and smaller stages), then fewer micro-batches (less
per-micro-batch overhead), then less recomputation (never, except_last, always), then the
schedule's place in `SCHEDULE_ORDER` (plainer schedules first), then the smaller dp and tp.
Only a candidate faster than the fastest by more than the margin wins on speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import schedules
from pipeline.planner.space import CHECKPOINTS, Candidate, Configuration

__all__ = ["NEAR", "SCHEDULE_ORDER", "choose", "near_ties", "simplicity", "stages_per_rank"]

# In runs of the README example (2 ranks, 16 MiB; docs/planning.md) on a loaded 2-core
# machine, the predicted steps of two near-tied candidates moved against each other by up to
# 5% from run to run (zb-v over interleaved from 1.00 to 1.05): 5% keeps those inside. A wider
# margin is no steadier: at 10% a simpler candidate 9.6% slower (1f1b, chunks 4) came inside
# in 1 run of 4 and was chosen; at 5% the chunk count moved (2 or 4) in 1 run of 6. Any margin
# has an edge that a candidate's noise can cross.
NEAR = 0.05
# Plainer first: one stage per rank and two kinds of action, then split backwards (three
# kinds), then two stages per rank, then weight versions and both directions at once.
SCHEDULE_ORDER = ("1f1b", "gpipe", "zb-h1", "zb-h1-tight", "zb-h2", "interleaved", "zb-v",
                  "2bw", "dualpipe-v")


def stages_per_rank(c: Configuration) -> int:
    gen = schedules.info(c.schedule)
    return dict(c.options).get(gen.stages_option or "", gen.stages_per_rank)


def simplicity(c: Configuration) -> tuple[object, ...]:
    """The order near ties are chosen in, simplest first (the module's docstring says why)."""
    place = (SCHEDULE_ORDER.index(c.schedule) if c.schedule in SCHEDULE_ORDER
             else len(SCHEDULE_ORDER))
    recompute = CHECKPOINTS.index(c.checkpoint) if c.checkpoint in CHECKPOINTS else len(
        CHECKPOINTS)
    return (stages_per_rank(c), c.chunks, recompute, place, c.schedule, c.options, c.dp,
            c.tp)


def _fastest(candidates: Sequence[Candidate]) -> float:
    steps = [c.step_time for c in candidates
             if c.status in ("chosen", "fits") and c.step_time is not None]
    return min(steps, default=math.inf)


def near_ties(candidates: Sequence[Candidate], margin: float = NEAR) -> list[Candidate]:
    """The simulated candidates that fit within `margin` of the fastest, simplest first."""
    fastest = _fastest(candidates)
    near = [c for c in candidates if c.status in ("chosen", "fits") and c.step_time is not None
            and c.step_time <= fastest * (1 + margin)]
    return sorted(near, key=simplicity)


def choose(candidates: Sequence[Candidate], margin: float = NEAR) -> Candidate | None:
    """The simplest near tie (None when no candidate was simulated and fits)."""
    near = near_ties(candidates, margin)
    return near[0] if near else None
