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

With a memory of the last choice for the same model and settings (`pipeline.planner.remembered`)
the choice has hysteresis: the last choice, re-predicted from this run's profile, is kept
unless a candidate is more than `KEEP` faster than it, or it is no longer a valid candidate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import schedules
from pipeline.planner.space import CHECKPOINTS, Candidate, Configuration

__all__ = ["KEEP", "NEAR", "SCHEDULE_ORDER", "choose", "identity", "named", "near_ties",
           "recalled", "simplicity", "stages_per_rank"]

# In runs of the README example (2 ranks, 16 MiB; docs/planning.md) on a loaded 2-core
# machine, the predicted steps of two near-tied candidates moved against each other by up to
# 5% from run to run (zb-v over interleaved from 1.00 to 1.05): 5% keeps those inside. A wider
# margin is no steadier: at 10% a simpler candidate 9.6% slower (1f1b, chunks 4) came inside
# in 1 run of 4 and was chosen; at 5% the chunk count moved (2 or 4) in 1 run of 6. Any margin
# has an edge that a candidate's noise can cross.
NEAR = 0.05
# The last choice was within NEAR of the fastest when chosen; a profile taken again moves two
# candidates against each other by up to 5% (above), so it may then lie up to 1.05 x 1.05 - 1
# = 10% from the fastest without anything having changed but the noise. At NEAR itself the
# memory would hold nothing the near ties do not (the measured flip was a choice just outside
# NEAR); keeping it within twice that costs at most 10% of predicted step, and a candidate
# more than 10% faster is taken.
KEEP = 2 * NEAR
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


def identity(c: Configuration) -> tuple[object, ...]:
    """What names a configuration, whatever was found of it: equal for the same candidate in
    two runs."""
    return (c.schedule, c.options, c.dp, c.pp, c.tp, c.chunks, c.rows, c.checkpoint)


def named(c: Configuration) -> str:
    """'zb-v, chunks 2, 'never'' (with dp and tp when above 1)."""
    return (f"{c.label}, chunks {c.chunks}, {c.checkpoint!r}" + (f", dp {c.dp}" if c.dp > 1
            else "") + (f", tp {c.tp}" if c.tp > 1 else ""))


def _held(candidates: Sequence[Candidate], last: Configuration) -> Candidate | None:
    return next((c for c in candidates if identity(c) == identity(last)), None)


def choose(candidates: Sequence[Candidate], margin: float = NEAR,
           last: Configuration | None = None, keep: float = KEEP) -> Candidate | None:
    """The simplest near tie (None when no candidate was simulated and fits); but `last`,
    the last choice, while it was simulated, fits, and no candidate is more than `keep`
    faster than it."""
    near = near_ties(candidates, margin)
    if not near:
        return None
    held = _held(candidates, last) if last is not None else None
    if (held is not None and held.status in ("chosen", "fits") and held.step_time is not None
            and held.step_time <= _fastest(candidates) * (1 + keep)):
        return held
    return near[0]


def _ms(c: Candidate) -> str:
    return "" if c.step_time is None else f", {c.step_time * 1e3:.2f} ms"


def recalled(candidates: Sequence[Candidate], last: Configuration, keep: float = KEEP) -> str:
    """What the last choice came to in a search whose chosen candidate is first: kept, replaced
    by a faster one (by how much, re-predicted), or dropped as no longer valid (and why)."""
    chosen = candidates[0]
    held = _held(candidates, last)
    if held is None or held.step_time is None or held.status not in ("chosen", "fits"):
        why = ("not among this run's candidates" if held is None else
               f"{held.status}: {held.reason}" if held.reason else held.status)
        return (f"the last choice ({named(last)}) is no longer valid: {why}; chose "
                f"{named(chosen)}{_ms(chosen)} afresh")
    fastest = min((c for c in candidates if c.status in ("chosen", "fits")
                   and c.step_time is not None), key=lambda c: c.step_time or 0.0)
    assert fastest.step_time is not None and chosen.step_time is not None
    if held is chosen:
        if identity(fastest) == identity(held) or held.step_time <= fastest.step_time:
            return f"kept the last choice ({named(held)}{_ms(held)}), the fastest of this run"
        return (f"kept the last choice ({named(held)}{_ms(held)}), within "
                f"{held.step_time / fastest.step_time - 1:.1%} of the fastest "
                f"({named(fastest)}{_ms(fastest)}; a candidate must be more than {keep:.0%} "
                f"faster to replace it)")
    said = (f"chose {named(chosen)} ({chosen.step_time * 1e3:.2f} ms): "
            f"{held.step_time / chosen.step_time - 1:.1%} faster than the last choice "
            f"({named(held)}) re-predicted ({held.step_time * 1e3:.2f} ms)")
    if identity(fastest) == identity(chosen):
        return f"{said}, more than the {keep:.0%} that keeps it"
    return (f"{said}; the fastest ({named(fastest)}{_ms(fastest)}) is "
            f"{held.step_time / fastest.step_time - 1:.1%} faster than it, more than the "
            f"{keep:.0%} that keeps it")
