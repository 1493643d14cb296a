"""What-ifs for the cost model, fitted on half the configurations and scored on the other half."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.planning.space import Config

__all__ = ["GRID", "calibrate", "fit_line", "halves"]

GRID = tuple(1.0 + 0.1 * i for i in range(31))  # contention factors tried: 1.0 .. 4.0


def halves(n: int) -> tuple[list[int], list[int]]:
    """Two disjoint halves of `range(n)` (alternate indices: configurations are listed roughly
    by kind, so each half holds every kind)."""
    return list(range(0, n, 2)), list(range(1, n, 2))


def _median_abs(predicted: Sequence[float], measured: Sequence[float]) -> float:
    return statistics.median(abs(p / m - 1) for p, m in zip(predicted, measured, strict=True))


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares `y = a + b x` (b = 0 when every x is the same)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
    return my - b * mx, b


def calibrate(configs: Sequence[Config], measured: Sequence[float], actions: Sequence[int],
              predict: Callable[[Config, float], float], contention: float,
              grid: Sequence[float] = GRID) -> dict[str, Any]:
    """How far two changes to the cost model's inputs would bring the median |error|, each
    fitted on one half of the configurations and scored on the other (then the other way
    round; the two scores' mean), against the same score with the `contention` measured:
    (1) the contention factor that fits best, instead of the measured one; (2) a contention
    factor with a cost per step and per compute action (`actions`: on the busiest rank), the
    costs fitted by least squares to what each factor's prediction leaves.
    `predict(config, contention)` gives a predicted step in seconds; `measured` the measured
    ones."""
    n = len(configs)
    if n < 4:
        return {"n": n}
    table = {c: [predict(cfg, c) for cfg in configs] for c in {*grid, contention}}
    scores: dict[str, list[float]] = {"as_measured": [], "contention": [],
                                      "contention_and_overheads": []}
    fitted: list[dict[str, float]] = []
    for fit, test in (halves(n), halves(n)[::-1]):
        def error_on(idx: list[int], c: float) -> float:
            return _median_abs([table[c][i] for i in idx], [measured[i] for i in idx])

        def corrected(c: float, fit: list[int] = fit) -> tuple[float, float, float]:
            """(median |error| on the fitting half, a, b) with `a + b x actions` fitted there
            to what the prediction at contention `c` leaves."""
            a, b = fit_line([float(actions[i]) for i in fit],
                            [measured[i] - table[c][i] for i in fit])
            return _median_abs([table[c][i] + a + b * actions[i] for i in fit],
                               [measured[i] for i in fit]), a, b

        scores["as_measured"].append(error_on(test, contention))
        alone = min(grid, key=lambda c: error_on(fit, c))
        scores["contention"].append(error_on(test, alone))
        joint = min(grid, key=lambda c: corrected(c)[0])
        _, a, b = corrected(joint)
        scores["contention_and_overheads"].append(_median_abs(
            [table[joint][i] + a + b * actions[i] for i in test], [measured[i] for i in test]))
        fitted.append({"contention_alone": alone, "contention": joint, "per_step_s": a,
                       "per_action_s": b})
    return {"n": n, "fitted": fitted, **{k: statistics.fmean(v) for k, v in scores.items()}}
