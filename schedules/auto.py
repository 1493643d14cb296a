"""`schedule="auto"`: a one-stage-per-rank schedule synthesised for given per-stage costs.

In the spirit of the zero-bubble paper's automatic scheduler (Qi et al., ICLR 2024): the
list-scheduling heuristic of `schedules.auto_greedy` runs under several settings (warm-up
depth per rank, when to run the W's), and every fixed generator of the registry that places
one stage per rank (gpipe, 1f1b, zb-h1, zb-h2, zb-h1-tight, ...) is a candidate too. Each
candidate is timed by `schedules.simulate` under the same costs, and the fastest one within
the memory limit is kept, so the result is never simulated slower than the best fixed
schedule at the same split and memory limit.

Memory: `memory_limit` is the most micro-batches whose activations one rank holds at once,
from a micro-batch's F until its backward is complete (its W, or its B), exactly as
`schedules.peak_activations` counts them. One int for every rank, or one per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from schedules.auto_greedy import FILLS, Policy, greedy
from schedules.ir import Op, Schedule, ScheduleError
from schedules.registry import available, info, register
from schedules.simulate import Costs, peak_activations, simulate

__all__ = ["Synthesis", "auto", "fixed_candidates", "policies", "search", "synthesize"]


@dataclass(frozen=True, slots=True)
class Synthesis:
    """What `search` found: the schedule (named "auto"), which candidate it is, its simulated
    makespan, and every candidate within the memory limit with its makespan, in the order
    tried (the fixed schedules first)."""

    schedule: Schedule
    chosen: str
    makespan: float
    candidates: tuple[tuple[str, float], ...]
    fixed: tuple[str, ...]

    @property
    def best_fixed(self) -> tuple[str, float] | None:
        """The fastest fixed schedule within the memory limit (None: none fits)."""
        fits = [c for c in self.candidates if c[0] in self.fixed]
        return min(fits, key=lambda c: c[1]) if fits else None


def synthesize(num_ranks: int, num_microbatches: int, costs: Costs | None = None,
               memory_limit: int | Sequence[int] | None = None) -> Schedule:
    """The fastest schedule `search` finds: a `Schedule` a `Pipe` takes as `schedule=`.

    `costs` (default: `Costs()`, F = I = W = 1, B = 2) may give one value per stage, i.e.
    per rank: give B = I + W per stage, so that a fixed schedule's B costs what the split
    backward costs. `memory_limit` (default: no limit but m) is described in the module.
    """
    return search(num_ranks, num_microbatches, costs, memory_limit).schedule


def search(num_ranks: int, num_microbatches: int, costs: Costs | None = None,
           memory_limit: int | Sequence[int] | None = None) -> Synthesis:
    """Every candidate (fixed schedules, then the heuristic's settings of `policies`) timed
    under `costs`; the least makespan wins, the first tried among equals (so a fixed schedule
    wins every tie). Deterministic: the same inputs give the same schedule on every rank."""
    p, m = _positive("num_ranks", num_ranks), _positive("num_microbatches", num_microbatches)
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        raise ScheduleError(f"costs must be a schedules.Costs (got {type(costs).__name__}); "
                            f"e.g. Costs(forward=[1, 1, 3], backward_input=[1, 1, 3], ...)")
    _check_lengths(costs, p)
    limits = _limits(memory_limit, p, m)
    found: list[tuple[str, float, Schedule]] = []
    fixed: list[str] = []
    for name, schedule in fixed_candidates(p, m):
        fixed.append(name)
        if _fits(schedule, limits):
            found.append((name, simulate(schedule, costs).makespan, schedule))
    seen: set[tuple[tuple[str, ...], ...]] = set()
    for policy in policies(p, m, costs, limits):
        schedule = greedy(p, m, costs, policy)
        rows = tuple(tuple(map(str, row)) for row in schedule.actions)
        if rows in seen or not _fits(schedule, limits):
            continue  # another setting placed the same actions already
        seen.add(rows)
        found.append((policy.label(), simulate(schedule, costs).makespan, schedule))
    best = min(range(len(found)), key=lambda i: (found[i][1], i))
    name, makespan, schedule = found[best]
    return Synthesis(schedule.replace(name="auto"), name, makespan,
                     tuple((n, t) for n, t, _ in found), tuple(fixed))


def fixed_candidates(num_ranks: int, num_microbatches: int) -> list[tuple[str, Schedule]]:
    """Every registered generator that places one stage per rank (loop placement, one batch
    per schedule), by its metadata, with the schedule it makes for p x m; not "auto"."""
    out = []
    for name in available():
        gen = info(name)
        if gen.synthesised or gen.stages_option is not None or gen.batches_option is not None:
            continue
        if gen.stages_per_rank != 1:
            continue
        schedule = gen.fn(num_ranks, num_microbatches)
        if (schedule.placement, schedule.num_stages, schedule.num_batches) != (
                "loop", num_ranks, 1):
            continue
        if any(a.op is Op.U or a.version is not None for row in schedule.actions for a in row):
            continue
        out.append((name, schedule))
    return out


def policies(num_ranks: int, num_microbatches: int, costs: Costs,
             limits: Sequence[int]) -> list[Policy]:
    """The heuristic's settings tried: per-rank caps (warm-up depths) times `FILLS`.

    Caps: the memory limit itself; 1F1B's depth p - r, deepened by 0 .. p - 1; and the depth
    that covers a rank's round trip at these costs (its F's until the first gradient can
    come back: the F's and I's of the ranks below it, and the transfers), plus 0 or 1. Each
    is clipped to [1, min(m, limit)]."""
    p, m = num_ranks, num_microbatches
    top = [min(m, limit) for limit in limits]
    depths: list[list[int]] = [list(top)]
    depths += [[p - r + extra for r in range(p)] for extra in range(p)]
    for extra in (0, 1):
        depths.append([_round_trip(costs, p, r) + extra for r in range(p)])
    caps: list[tuple[int, ...]] = []
    for depth in depths:
        clipped = tuple(max(1, min(d, t)) for d, t in zip(depth, top, strict=True))
        if clipped not in caps:
            caps.append(clipped)
    return [Policy(c, fill) for c in caps for fill in FILLS]


@register("auto", synthesised=True)
def auto(num_ranks: int, num_microbatches: int) -> Schedule:
    """`search` at equal unit costs (F = I = W = 1, B = 2) under 1F1B's memory, p micro-batches
    per rank: there zb-h1 is optimal (3m + p - 1 for m >= p), so `auto` is zb-h1 (1f1b for
    p = 1, gpipe for p = m = 1). For measured costs call `synthesize` and pass its Schedule.

    p=3, m=4 (zb-h1's order)::

        r0  0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
        r1  1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
        r2  2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3
    """
    return synthesize(num_ranks, num_microbatches, memory_limit=num_ranks)


def _round_trip(costs: Costs, p: int, r: int) -> int:
    """How many of its F's rank r can run before its first gradient can arrive: 1 plus the
    time from its first F's end to that gradient, over its F's duration."""
    trip = sum(costs.of(Op.F, s) + costs.of(Op.I, s) for s in range(r + 1, p))
    trip += 2 * (p - 1 - r) * costs.comm
    own = costs.of(Op.F, r)
    if own <= 0:
        return p - r
    return 1 + math.ceil(trip / own - 1e-9)


def _fits(schedule: Schedule, limits: Sequence[int]) -> bool:
    peaks = peak_activations(schedule.actions)
    return all(peak <= limit for peak, limit in zip(peaks, limits, strict=True))


def _positive(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"auto: {what} must be an int >= 1 (got {value!r})")
    return value


def _limits(memory_limit: int | Sequence[int] | None, p: int, m: int) -> list[int]:
    if memory_limit is None:
        return [m] * p
    values = [memory_limit] * p if isinstance(memory_limit, int) else list(memory_limit)
    if len(values) != p or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                               for v in values):
        raise ScheduleError(
            f"auto: memory_limit must be an int >= 1 or one such int per rank ({p}) (got "
            f"{memory_limit!r}): the most micro-batches a rank may hold from F until W; 1 "
            f"runs each micro-batch's F, I and W before the next F")
    return [min(v, m) for v in values]


def _check_lengths(costs: Costs, p: int) -> None:
    """Per-stage costs must give one value per stage: one stage per rank here."""
    for name in ("forward", "backward", "backward_input", "backward_weight"):
        value = getattr(costs, name)
        if isinstance(value, tuple) and len(value) != p:
            raise ScheduleError(f"auto: Costs.{name} gives {len(value)} values for {p} stages "
                                f"(one stage per rank); give one per stage or one for all")
