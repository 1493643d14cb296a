"""Quantiles and percentile intervals, and a bootstrap interval of a median over rounds."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

__all__ = ["interval", "median_interval", "quantile"]


def quantile(values: Sequence[float], q: float) -> float:
    """The `q`-quantile of `values` (linear between order statistics)."""
    data = sorted(values)
    if not data:
        raise ValueError("a quantile of no values")
    pos = q * (len(data) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The central percentile interval holding `level` of `values`."""
    tail = (1 - level) / 2
    return quantile(values, tail), quantile(values, 1 - tail)


def median_interval(values: Sequence[float], *, replicates: int = 2000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of `values` (one per round: resampling
    rounds, not steps, since the steps of one round shared the machine's state)."""
    if not values:
        raise ValueError("an interval of no values")
    rng = random.Random(seed)
    n = len(values)
    medians = [statistics.median([values[rng.randrange(n)] for _ in range(n)])
               for _ in range(replicates)]
    return interval(medians, level)
