"""The fitted time model scored on configurations held out of its fit, both halves each way."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.planning.calibrate import halves
from benchmarks.planning.space import Config
from pipeline.planner import Sample, TimeModel, fit_time_model
from schedules import Timeline

__all__ = ["time_model_what_if"]


def time_model_what_if(configs: Sequence[Config], steps: Sequence[Sequence[tuple[float, Timeline]]],
                       alone: Sequence[Timeline], medians: Sequence[float],
                       predict: Callable[[Config, TimeModel], float],
                       rows: Sequence[int] | None = None) -> dict[str, Any]:
    """Fit `fit_time_model` on the measured steps of one half of the configurations (each
    step's timeline beside the planner's uncontended prediction `alone`; under dp, the other
    replicas' compute in its `meta["beside"]`; `rows`, each configuration's micro-batch rows,
    for a compute scale per size) and score it on the other half: |predicted / measured
    median - 1| per held-out configuration (`predict(config, model)` in seconds), then the
    halves swapped. Reports the median |error| over both held-out halves, the share within
    5 %, 10 % and 20 %, and each half's fitted terms; with `rows`, also the median |error| of
    the model with one compute scale for every size (`one_scale`)."""
    n = len(configs)
    if n < 4:
        return {"n": n}

    def scored(sizes: Sequence[int | None]) -> tuple[list[float], list[dict[str, Any]]]:
        errors: list[float] = []
        fitted: list[dict[str, Any]] = []
        for fit, test in (halves(n), halves(n)[::-1]):
            model = fit_time_model(Sample(tl, alone[i], s, tuple(tl.meta.get("beside", ())),
                                          sizes[i]) for i in fit for s, tl in steps[i])
            errors += [predict(configs[i], model) / medians[i] - 1 for i in test]
            fitted.append({k: v for k, v in asdict(model).items() if k != "machine"})
        return errors, fitted

    errors, fitted = scored(list(rows) if rows is not None else [None] * n)
    size = [abs(e) for e in errors]
    out = {"n": n, "median_abs": statistics.median(size),
           "within": {str(p): sum(e <= p / 100 for e in size) / len(size) for p in (5, 10, 20)},
           "predicted_low": sum(e < 0 for e in errors) / len(errors), "fitted": fitted}
    if rows is not None:
        one, _ = scored([None] * n)
        out["one_scale"] = {"median_abs": statistics.median(abs(e) for e in one)}
    return out
