"""Token micro-batches' rows and order: rows grouped by balanced tokens, groups run in the order
the simulator times fastest (`tokens.py` cuts and trims them)."""

from __future__ import annotations

from collections.abc import Sequence

from schedules import Costs, Schedule
from schedules.simulate import makespan

__all__ = ["group", "order"]


def group(lengths: Sequence[int], chunks: int) -> list[list[int]]:
    """Rows (indices into `lengths`) in `chunks` groups, longest rows first, minimising the
    largest group's cost (rows x its longest row), then splitting the costliest further.

    Groups contiguous in order of length waste the least padding; a greedy fill under a cap is
    feasible whenever any contiguous grouping is (filling a group fuller only leaves later,
    shorter rows), so a binary search on the cap finds the least one exactly.
    """
    rows = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    size = [max(lengths[r], 1) for r in rows]  # a row of no tokens still costs a slot

    def fill(cap: int) -> list[list[int]] | None:
        out: list[list[int]] = []
        first = 0  # the current group's longest row: its first
        for i, r in enumerate(rows):
            if out and (len(out[-1]) + 1) * first <= cap:
                out[-1].append(r)
            else:
                if len(out) == chunks or size[i] > cap:
                    return None
                out.append([r])
                first = size[i]
        return out

    low, high = size[0] if size else 1, max(1, len(rows) * (size[0] if size else 1))
    while low < high:
        mid = (low + high) // 2
        if fill(mid) is None:
            low = mid + 1
        else:
            high = mid
    groups = fill(low) or [[r] for r in rows]
    while len(groups) < chunks:  # fewer groups fit: split the costliest (never raises the max)
        k = max((k for k in range(len(groups)) if len(groups[k]) > 1),
                key=lambda k: len(groups[k]) * max(lengths[r] for r in groups[k]))
        half = (len(groups[k]) + 1) // 2
        groups[k:k + 1] = [groups[k][:half], groups[k][half:]]
    return groups


def order(costs: Sequence[float], program: Schedule | None) -> list[int]:
    """The run order of micro-batches of `costs`: costliest first, cheapest first, or
    alternating, whichever the simulator times fastest under `program` (costliest first on a
    tie, or without a program)."""
    by_cost = sorted(range(len(costs)), key=lambda k: (-costs[k], k))
    candidates = [by_cost, by_cost[::-1],
                  [by_cost[i // 2] if i % 2 == 0 else by_cost[-1 - i // 2]
                   for i in range(len(by_cost))]]
    if program is None or len(costs) < 2 or program.num_microbatches != len(costs):
        return by_cost
    best, best_time = by_cost, float("inf")
    top = max(max(costs), 1e-9)
    for candidate in candidates:
        # Only the makespan counts: `makespan` times the program's kept graph (built at its
        # first step) and makes no timeline.
        time = makespan(program, Costs(microbatch=[costs[k] / top for k in candidate]))
        if time < best_time - 1e-9:
            best, best_time = candidate, time
    return best
