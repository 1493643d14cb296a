"""One model and transport's planning record: every measurement, the standings, the error."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.planning.rounds import Measured, steps_of
from benchmarks.planning.space import Config, Entry, index_of
from benchmarks.planning.stats import (
    anatomy,
    bootstrap,
    decompose,
    error_summary,
    noise,
    spearman,
    standing,
)
from pipeline.planner import Candidate
from schedules import Timeline

__all__ = ["config_rows", "error_sources", "results_for", "round_seconds", "timeline_json"]

_SLACK = 1 + 1e-9  # a measured peak equal to the budget fits


def _r(x: float) -> float:
    return round(x, 7)  # seconds to 0.1 us: what a timer on this machine resolves, and smaller


def round_seconds(measured: Sequence[Sequence[Measured]]) -> list[list[float]]:
    """`[config][round]`: the median of each turn's timed steps."""
    return [[statistics.median(row[i].step_s) for row in measured]
            for i in range(len(measured[0]))]


def config_rows(entries: Sequence[Entry], measured: Sequence[Sequence[Measured]],
                predict: Callable[[Config, float], Candidate], contention: float,
                allreduce: Callable[[Config], float] = lambda c: 0.0) -> list[dict[str, Any]]:
    """Per configuration: what it is and why it was measured, its prediction (with the
    measured contention and without any), every measured step (per round) with the anatomy of
    its timeline, the peaks, the error and where the error comes from; under dp, the
    all-reduce's seconds measured (`allreduce`: the planner's for the busiest rank)."""
    rounds = round_seconds(measured)
    out = []
    for i, entry in enumerate(entries):
        c = entry.config
        guess, alone = predict(c, contention), predict(c, 1.0)
        assert guess.step_time is not None and guess.timeline is not None
        assert alone.timeline is not None and alone.step_time is not None
        planned = anatomy(guess.timeline)
        steps = steps_of(measured, i)
        shapes = [anatomy(tl, s) for s, tl in steps]
        parts = [decompose(planned, a) for a in shapes]
        mean_step = statistics.fmean(a.step for a in shapes)
        median = statistics.median(rounds[i])
        alone_busy = max(anatomy(alone.timeline).busy)
        reduced = [s for row in measured for s in row[i].allreduce_s]
        exposed = [s for row in measured for s in row[i].exposed_s]
        out.append({
            "key": c.key, "aliases": entry.aliases, "origins": entry.origins,
            "config": asdict(c),
            "predicted": {"step_s": guess.step_time, "peak_bytes": list(guess.peak_bytes or ()),
                          "alone_step_s": alone.step_time, "anatomy": planned.to_dict(),
                          "alone_busy_s": list(anatomy(alone.timeline).busy)},
            "measured": {
                "median_s": median, "round_s": rounds[i],
                "step_s": [[_r(s) for s in row[i].step_s] for row in measured],
                "peak_bytes": measured[0][i].peaks,
                "anatomy": [{k: (_r(v) if isinstance(v, float) else
                                 [_r(x) if isinstance(x, float) else x for x in v]
                                 if isinstance(v, list) else v)
                             for k, v in a.to_dict().items()} for a in shapes]},
            "error": guess.step_time / median - 1,
            # Seconds, averaged over every timed step: they add up to predicted - mean step.
            "error_parts_s": {k: statistics.fmean(p[k] for p in parts) for k in parts[0]},
            "mean_step_s": mean_step,
            "slowdown": {"measured": statistics.median(max(a.busy) for a in shapes) / alone_busy
                         if alone_busy > 0 else math.nan,
                         "predicted": max(planned.busy) / alone_busy
                         if alone_busy > 0 else math.nan},
            "data_parallel": None if c.dp == 1 else {
                "allreduce_s": [_r(s) for s in reduced], "exposed_s": [_r(s) for s in exposed],
                "predicted_allreduce_s": allreduce(c),
                "predicted_exposed_s": guess.allreduce_time},
        })
    return out


def results_for(rows: Sequence[dict[str, Any]], entries: Sequence[Entry], limit: float,
                plan: Config, default: Config, *, replicates: int, seed: int) -> dict[str, Any]:
    """Under one budget: the plan's and the default's rank among the configurations whose
    measured peak fits, their regret against the fastest of them, with bootstrap intervals."""
    times = [r["measured"]["round_s"] for r in rows]
    eligible = [max(r["measured"]["peak_bytes"], default=0) <= limit * _SLACK for r in rows]
    who = {"plan": index_of(entries, plan), "default": index_of(entries, default)}
    intervals = bootstrap(times, eligible, list(who.values()), replicates=replicates, seed=seed)
    out: dict[str, Any] = {"limit_bytes": None if math.isinf(limit) else limit,
                           "eligible": sum(eligible), "measured": len(rows)}
    for (name, i), ci in zip(who.items(), intervals, strict=True):
        s = standing(times, eligible, i)
        out[name] = {"key": rows[i]["key"], "asked_as": (plan if name == "plan" else default).key,
                     "rank": s.rank, "regret": s.regret, "fits_measured": eligible[i],
                     "median_s": rows[i]["measured"]["median_s"],
                     "predicted_step_s": rows[i]["predicted"]["step_s"], **ci}
        out["best"] = {"key": rows[s.best]["key"],
                       "median_s": rows[s.best]["measured"]["median_s"],
                       "predicted_step_s": rows[s.best]["predicted"]["step_s"]}
    fits = [r for r, ok in zip(rows, eligible, strict=True) if ok]
    out["spearman"] = spearman([r["predicted"]["step_s"] for r in fits],
                               [r["measured"]["median_s"] for r in fits])
    out["noise"] = noise([r["measured"]["round_s"] for r in fits])
    return out


def error_sources(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The prediction error over every measured configuration, and where it comes from: each
    part's median share of the step, and the median |error| were that part predicted exactly;
    the busiest rank's slowdown over its uncontended compute, measured and as predicted; the
    runtime's idle time with input ready; the message wait, measured and simulated."""
    errors = [r["error"] for r in rows]
    out: dict[str, Any] = {"error": error_summary(errors)}
    total = [r["error_parts_s"]["total"] / r["mean_step_s"] for r in rows]
    out["mean_based_median_abs"] = statistics.median(abs(t) for t in total) if total else None
    parts: dict[str, Any] = {}
    for k in ("compute", "idle", "outside"):
        share = [r["error_parts_s"][k] / r["mean_step_s"] for r in rows]
        parts[k] = {"median_share": statistics.median(share) if share else None,
                    "median_abs_without": statistics.median(
                        abs(t - s) for t, s in zip(total, share, strict=True)) if share else None}
    out["parts"] = parts

    def med(values: list[float]) -> float | None:
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else None

    out["slowdown_measured"] = med([r["slowdown"]["measured"] for r in rows])
    out["slowdown_predicted"] = med([r["slowdown"]["predicted"] for r in rows])
    out["idle_with_input_ready_s"] = med([statistics.median(
        a["idle_with_input_ready_s"] for a in r["measured"]["anatomy"]) for r in rows])
    out["outside_s"] = med([-r["error_parts_s"]["outside"] for r in rows])
    out["message_wait_s"] = med([statistics.median(
        a["message_wait_s"] for a in r["measured"]["anatomy"]) for r in rows])
    out["message_wait_predicted_s"] = med([r["predicted"]["anatomy"]["message_wait_s"]
                                           for r in rows])
    # By micro-batch count: at one micro-batch a 2-rank pipeline's ranks never compute at once
    # (each waits for the other), so its slowdown is the compute's own, contention aside.
    out["by_chunks"] = {str(m): {
        "n": len(group), "median_error": med([r["error"] for r in group]),
        "slowdown_measured": med([r["slowdown"]["measured"] for r in group]),
        "slowdown_predicted": med([r["slowdown"]["predicted"] for r in group])}
        for m in sorted({r["config"]["chunks"] for r in rows})
        for group in [[r for r in rows if r["config"]["chunks"] == m]]}
    dp = [r for r in rows if r["data_parallel"] and r["data_parallel"]["allreduce_s"]]
    out["data_parallel"] = None if not dp else {
        "n": len(dp), "median_error": med([r["error"] for r in dp]),
        **{f"{k}_measured_s": med([statistics.median(r["data_parallel"][f"{k}_s"]) for r in dp])
           for k in ("allreduce", "exposed")},
        **{f"{k}_predicted_s": med([r["data_parallel"][f"predicted_{k}_s"] for r in dp])
           for k in ("allreduce", "exposed")}}
    return out


def timeline_json(tl: Timeline, meta: Mapping[str, Any]) -> str:
    """A timeline with `meta` added, as pipeviz reads it."""
    return Timeline(tl.num_ranks, tl.events, tl.unit, {**tl.meta, **meta}).to_json()
