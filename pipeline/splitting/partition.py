"""Exact contiguous min-max partition of a cost sequence (the balancer's core)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

__all__ = ["BalanceError", "Fits", "bounds", "min_max_split", "partition", "partition_by_reach",
           "split_sizes", "stage_of"]

Fits = Callable[[int, int, int], bool]
"""`fits(part, start, stop)`: may layers `start..stop-1` form part `part`? (e.g. a memory limit)"""


class BalanceError(ValueError):
    """A balance (layers per stage) that cannot describe the model."""


def partition(costs: Sequence[float], num_parts: int, *, fits: Fits | None = None) -> list[int]:
    """Split `costs` into `num_parts` non-empty contiguous parts minimising the largest part sum.

    Returns the part sizes (a balance). Exact: `min_max_split` over prefix sums. Among optimal
    splits it keeps the last stage as short as possible, since the last stage also computes
    the loss. With `fits`, only parts it accepts are used (the split is then the best among
    those that fit; a `BalanceError` when none does).
    """
    n = len(costs)
    if num_parts < 1:
        raise BalanceError(f"need at least one part (got num_parts={num_parts})")
    if n < num_parts:
        raise BalanceError(
            f"cannot split {n} layers into {num_parts} non-empty stages: use at most {n} stages"
        )
    if any(c < 0 for c in costs):
        raise BalanceError(f"layer costs must be >= 0 (got {list(costs)})")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(part: int, start: int, stop: int) -> float:
        if fits is not None and not fits(part, start, stop):
            return math.inf  # a part that does not fit is never chosen over one that does
        return prefix[stop] - prefix[start]

    if fits is None:
        sizes, worst = _bisected_split(prefix, num_parts)
    else:
        sizes, worst = min_max_split(n, num_parts, cost)
    if worst == math.inf:
        raise BalanceError(f"no split of {n} layers into {num_parts} stages has every stage "
                           f"within its limit: raise the limit or use other stages")
    return sizes


def min_max_split(num_items: int, num_parts: int,
                  cost: Callable[[int, int, int], float]) -> tuple[list[int], float]:
    """The contiguous split of `num_items` into `num_parts` non-empty parts minimising the
    largest `cost(part, start, stop)`, and that largest cost (inf: no split of finite cost).
    Exact (dynamic programming, at most k n^2 calls of `cost`); a part's cost may depend on
    its position, so this also finds, for instance, the split needing the least memory on its
    fullest stage."""
    if num_parts < 1 or num_items < num_parts:
        raise BalanceError(f"cannot split {num_items} layers into {num_parts} non-empty "
                           f"stages: use between 1 and {num_items} stages")
    inf = float("inf")
    best = [[inf] * (num_items + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (num_items + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, num_items - (num_parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(k - 1, j, i))
                # `<=` keeps the latest cut among ties: the last part stays short.
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], num_items
    for k in range(num_parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1], best[num_parts][num_items]


def partition_by_reach(costs: Sequence[float], k: int, fits: Fits) -> list[int]:
    """`partition(costs, k, fits=fits)` for a `fits` that only gets harder as a part grows at
    its end (a stage's memory does: more parameters, more saved tensors, the same input): the
    same split, asking `fits` O(k n log n) times instead of O(k n^2). Each part's furthest
    fitting stop from each start is found by bisection, then whether any split fits at all
    (O(k n)), and only then the exact min-max split, over those reaches."""
    n = len(costs)
    reach: list[dict[int, int]] = []
    for s in range(k):
        row: dict[int, int] = {}
        top = n - (k - s - 1)  # later parts need a layer each
        for j in range(s, n - (k - s) + 1):
            lo, hi = j, top  # lo: a stop known to fit (j: the empty part)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(s, j, mid):
                    lo = mid
                else:
                    hi = mid - 1
            row[j] = lo
        reach.append(row)
    reached = {0}
    for s in range(k):
        ends = [0] * (n + 2)  # a difference array of the stops reachable after part s
        for j in reached:
            stop = reach[s].get(j, j)
            if stop > j:
                ends[j + 1] += 1
                ends[stop + 1] -= 1
        running, reached = 0, set()
        for i in range(n + 1):
            running += ends[i]
            if running > 0:
                reached.add(i)
    if n not in reached:
        raise BalanceError(f"no split of {n} layers into {k} stages has every stage within "
                           f"its limit: raise the limit or use other stages")
    return partition(costs, k, fits=lambda s, j, i: i <= reach[s].get(j, j))


def _bisected_split(prefix: Sequence[float], num_parts: int) -> tuple[list[int], float]:
    """`min_max_split` for parts costing `prefix[stop] - prefix[start]`, the same split, in
    O(k n log n) instead of O(k n^2). With costs >= 0, the best of the first j items in k - 1
    parts never decreases with j and the last part's cost never increases, so their maximum
    falls then rises in j: bisection finds where they cross, and the latest cut among equal
    minima (the dynamic programme's choice) is the last j whose first term stays within it.
    Planning a deep model over many stages calls this thousands of times."""
    n = len(prefix) - 1
    inf = math.inf
    prev = [0.0] + [inf] * n  # the best of the first j items in k - 1 parts (k = 1: none)
    cuts: list[list[int]] = []
    for k in range(1, num_parts + 1):
        cur = [inf] * (n + 1)
        cut = [0] * (n + 1)
        lo = k - 1
        for i in range(k, n - (num_parts - k) + 1):
            top, whole = i - 1, prefix[i]
            a, b = lo, top + 1  # the first j where prev[j] >= the last part's cost
            while a < b:
                mid = (a + b) // 2
                if prev[mid] >= whole - prefix[mid]:
                    b = mid
                else:
                    a = mid + 1
            left = whole - prefix[a - 1] if a > lo else inf
            right = prev[a] if a <= top else inf
            best = min(left, right)
            if right <= best:  # the minimum is reached where prev[j] rules: its last j
                a2, b2 = a, top
                while a2 < b2:
                    mid = (a2 + b2 + 1) // 2
                    if prev[mid] <= best:
                        a2 = mid
                    else:
                        b2 = mid - 1
                j = a2
            else:
                j = a - 1
            cur[i], cut[i] = best, j
        cuts.append(cut)
        prev = cur
    sizes, i = [], n
    for k in range(num_parts, 0, -1):
        j = cuts[k - 1][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1], prev[n]


def bounds(balance: Sequence[int]) -> list[int]:
    """Index of each stage's first layer, and the number of layers at the end: [2, 3] gives
    [0, 2, 5] (stage s holds layers bounds[s] .. bounds[s + 1] - 1)."""
    return [0, *itertools.accumulate(balance)]


def stage_of(balance: Sequence[int]) -> list[int]:
    """The stage of each layer: [2, 3] gives [0, 0, 1, 1, 1]."""
    return [s for s, size in enumerate(balance) for _ in range(size)]


def split_sizes(total: int, num_parts: int) -> list[int]:
    """Near-equal sizes, larger first: 10 into 4 gives [3, 3, 2, 2]."""
    base, extra = divmod(total, num_parts)
    return [base + (1 if i < extra else 0) for i in range(num_parts)]
