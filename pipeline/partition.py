"""Exact contiguous min-max partition of a cost sequence (the balancer's core)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BalanceError", "partition", "split_sizes"]


class BalanceError(ValueError):
    """A balance (layers per stage) that cannot describe the model."""


def partition(costs: Sequence[float], num_parts: int) -> list[int]:
    """Split `costs` into `num_parts` non-empty contiguous parts minimising the largest part sum.

    Returns the part sizes (a balance). Exact, by dynamic programming over prefix sums in
    O(k * n^2). Among optimal splits it keeps the last stage as short as possible, since the
    last stage also computes the loss.
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
    inf = float("inf")
    # best[k][i]: smallest possible largest part when the first i layers form k parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):  # the last part is layers j..i-1
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                # `<=` keeps the latest cut among ties: the last part stays short.
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def split_sizes(total: int, num_parts: int) -> list[int]:
    """Near-equal sizes, larger first: 10 into 4 gives [3, 3, 2, 2]."""
    base, extra = divmod(total, num_parts)
    return [base + (1 if i < extra else 0) for i in range(num_parts)]
