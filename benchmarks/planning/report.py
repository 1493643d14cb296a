"""The planning benchmark's markdown report: standings, prediction error and its sources."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from pipeline.planner import format_bytes

__all__ = ["noise_floor", "report"]


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _rank(who: dict[str, Any], n: int) -> str:
    lo, hi = who["rank_ci"]
    return f"{who['rank']} of {n} [{lo:.0f}, {hi:.0f}]"


def _regret(who: dict[str, Any]) -> str:
    lo, hi = who["regret_ci"]
    return f"{_pct(who['regret'])} [{_pct(lo)}, {_pct(hi)}]"


def _standings(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| model | transport | budget | fit / measured | plan | plan's rank [95% CI] | "
             "plan's regret [95% CI] | P(plan fastest) | default's rank [95% CI] | default's "
             "regret [95% CI] | fastest measured | its ms | round-to-round CV | planning s "
             "(trials) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        for budget, res in r["results"].items():
            limit = res["limit_bytes"]
            size = "none" if limit is None else format_bytes(limit)
            plan, default, n = res["plan"], res["default"], res["eligible"]
            note = "" if plan["fits_measured"] else " (over budget, measured)"
            lines.append(
                f"| {r['model']} | {r['transport']} | {budget}: {size} | {n} / {res['measured']}"
                f" | {plan['asked_as']}{note} | {_rank(plan, n)} | {_regret(plan)} | "
                f"{plan['p_best']:.2f} | {_rank(default, n)} | {_regret(default)} | "
                f"{res['best']['key']} | {_ms(res['best']['median_s'])} | "
                f"{_pct(res['noise']['median_cv'])} | {plan.get('planning_s', 0.0):.1f} "
                f"({plan.get('trials', 0)}) |")
    for r in records:
        for budget, why in r.get("plan_errors", {}).items():
            lines.append(f"| {r['model']} | {r['transport']} | {budget} | - | the planner found "
                         f"no configuration: {why} | | | | | | | | | |")
    return lines


def _errors(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| model | transport | configurations | median \\|error\\| | \\|error\\| 10% - 90% "
             "| within 5% / 10% / 20% | predicted low | Spearman, predicted vs measured |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        e = r["error_sources"]["error"]
        q = e["abs_quantiles"]
        w = e["within"]
        rho = " / ".join(f"{res['spearman']:.2f}" for res in r["results"].values())
        lines.append(
            f"| {r['model']} | {r['transport']} | {e['n']} | {_pct(e['median_abs'])} | "
            f"{_pct(q['0.1'])} - {_pct(q['0.9'])} | {_pct(w['5%'], 0)} / {_pct(w['10%'], 0)} "
            f"/ {_pct(w['20%'], 0)} | {_pct(e['under_predicted'], 0)} | {rho} |")
    return lines


def _sources(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| model | transport | compute | idle in the span | outside the span | median "
             "\\|error\\| (mean step) | ... compute exact | ... idle exact | ... outside exact "
             "| slowdown measured / predicted | idle, input ready | before + after the actions "
             "| message wait measured / simulated |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        s = r["error_sources"]
        p = s["parts"]
        slow = ("-" if s["slowdown_measured"] is None else
                f"{s['slowdown_measured']:.2f} / {s['slowdown_predicted']:.2f}")
        lines.append(
            f"| {r['model']} | {r['transport']} | {_pct(p['compute']['median_share'])} | "
            f"{_pct(p['idle']['median_share'])} | {_pct(p['outside']['median_share'])} | "
            f"{_pct(s['mean_based_median_abs'])} | "
            f"{_pct(p['compute']['median_abs_without'])} | "
            f"{_pct(p['idle']['median_abs_without'])} | "
            f"{_pct(p['outside']['median_abs_without'])} | {slow} | "
            f"{_ms(s['idle_with_input_ready_s'])} ms | {_ms(s['outside_s'])} ms | "
            f"{_ms(s['message_wait_s'])} / {_ms(s['message_wait_predicted_s'])} ms |")
    return lines


def _by_chunks(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| model | transport | micro-batches: configurations, median error, busiest rank's "
             "slowdown measured / predicted |", "|---|---|---|"]
    for r in records:
        cells = [f"m={m}: {g['n']}, {_pct(g['median_error'])}, "
                 + ("-" if g["slowdown_measured"] is None else
                    f"{g['slowdown_measured']:.2f} / {g['slowdown_predicted']:.2f}")
                 for m, g in r["error_sources"].get("by_chunks", {}).items()]
        lines.append(f"| {r['model']} | {r['transport']} | {'; '.join(cells)} |")
    return lines


def _data_parallel(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| model | transport | dp > 1 configurations | their median error | all-reduce ms "
             "measured / predicted | exposed ms measured / predicted |",
             "|---|---|---|---|---|---|"]
    for r in records:
        d = r["error_sources"].get("data_parallel")
        if d:
            lines.append(
                f"| {r['model']} | {r['transport']} | {d['n']} | {_pct(d['median_error'])} | "
                f"{_ms(d['allreduce_measured_s'])} / {_ms(d['allreduce_predicted_s'])} | "
                f"{_ms(d['exposed_measured_s'])} / {_ms(d['exposed_predicted_s'])} |")
    return lines


def _drift(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| model | transport | profile after / before the steps (rows per micro-batch) | "
             "contention before / after |", "|---|---|---|---|"]
    for r in records:
        d = r.get("drift")
        if d:
            ratios = ", ".join(f"{k}: {v:.2f}" for k, v in d["profile_after_over_before"].items())
            lines.append(f"| {r['model']} | {r['transport']} | {ratios} | "
                         f"{d['contention_before']:.2f} / {d['contention_after']:.2f} |")
    return lines


def noise_floor(configs: Sequence[dict[str, Any]], resamples: int = 200, seed: int = 0
                ) -> float:
    """What a perfect model's median |error| would still be: per configuration, the mean
    |median of the rounds resampled / their median - 1| (the measurement's own error), then
    the median over configurations."""
    rng = random.Random(seed)
    floors = []
    for c in configs:
        rounds = c["measured"]["round_s"]
        middle = statistics.median(rounds)
        floors.append(statistics.fmean(
            abs(statistics.median(rng.choices(rounds, k=len(rounds))) / middle - 1)
            for _ in range(resamples)))
    return statistics.median(floors)


def _what_if(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| model | transport | median \\|error\\|, contention as measured | ... the "
             "contention that fits best | ... and a cost per step and per action | fitted "
             "(each half) | the fitted time model: median \\|error\\|, within 5 / 10 / 20 % | "
             "its terms (each half) | the measurement's own error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        w = r.get("what_if", {})
        if "fitted" not in w:
            continue
        fitted = "; ".join(f"{f['contention_alone']:.1f}x; {f['contention']:.1f}x with "
                           f"{f['per_step_s'] * 1e3:+.2f} ms + {f['per_action_s'] * 1e6:+.0f} "
                           f"us/action" for f in w["fitted"])
        lines.append(f"| {r['model']} | {r['transport']} ({r['contention']:.2f}x) | "
                     f"{_pct(w['as_measured'])} | {_pct(w['contention'])} | "
                     f"{_pct(w['contention_and_overheads'])} | {fitted} | "
                     f"{_time_model(w.get('time_model', {}))} | "
                     f"{_pct(noise_floor(r['configs']))} |")
    return lines


def _time_model(w: dict[str, Any]) -> str:
    """The fitted time model's held-out score and terms, as two table cells."""
    if "median_abs" not in w:
        return "- | -"
    within = " / ".join(f"{w['within'][p] * 100:.0f}%" for p in ("5", "10", "20"))
    def sizes(f: dict[str, Any]) -> str:
        got = f.get("rows") or {}
        # Sizes in order, as ints whether from the run or from results.json (str keys).
        return (" (by rows: " + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(
            got.items(), key=lambda kv: int(kv[0])))
                + ")") if got else ""

    terms = "; ".join(f"compute {f['compute']:.2f}x{sizes(f)}, contention "
                      f"{f['contention']:.2f}x, {f['action'] * 1e6:.0f} us/action, "
                      f"{f['message'] * 1e6:.0f} us/message, {f['step'] * 1e3:.2f} ms/step, "
                      f"all-reduce {f['allreduce']:.2f}x" for f in w["fitted"])
    one = (f" (one compute scale: {_pct(w['one_scale']['median_abs'])})"
           if "one_scale" in w else "")
    return f"{_pct(w['median_abs'])}{one}, {within} | {terms}"


def _fastest(r: dict[str, Any], top: int) -> list[str]:
    rows = sorted(r["configs"], key=lambda c: c["measured"]["median_s"])[:top]
    lines = [f"**{r['model']}, {r['transport']}**: the {top} fastest of {len(r['configs'])} "
             f"measured", "", "| configuration | why measured | measured ms (rounds: min-max) | "
             "predicted ms | error | peak MiB measured / predicted |", "|---|---|---|---|---|---|"]
    for c in rows:
        m = c["measured"]
        lo, hi = min(m["round_s"]), max(m["round_s"])
        peak = max(m["peak_bytes"], default=0) / 2**20
        guess = max(c["predicted"]["peak_bytes"], default=0) / 2**20
        lines.append(f"| {c['key']} | {', '.join(c['origins'])} | {_ms(m['median_s'])} "
                     f"({_ms(lo)}-{_ms(hi)}) | {_ms(c['predicted']['step_s'])} | "
                     f"{_pct(c['error'])} | {peak:.1f} / {guess:.1f} |")
    return lines


def report(records: Sequence[dict[str, Any]], command: str = "", top: int = 5) -> str:
    """The results as markdown."""
    lines = ["# The planner against every configuration, measured alike", ""]
    if command:
        lines += [f"`{command}`", ""]
    if records:
        r0 = records[0]
        lines += [f"Every configuration took one turn per round, {r0['rounds']} rounds in an "
                  f"order shuffled each round; a turn is a fresh Pipe, {r0['warmup']} warm-up "
                  f"and {r0['steps']} timed steps, whose median is the round's figure. Rank, "
                  f"regret and which is fastest use each configuration's median over the "
                  f"rounds; intervals are percentiles of {r0['replicates']} bootstrap "
                  f"resamples of the rounds (the best chosen again in each). Only "
                  f"configurations whose measured peak fits the budget are ranked.", ""]
    lines += ["## The plan's and the default's standing", "", *_standings(records), "",
              "## Predicted against measured step, every configuration", "", *_errors(records),
              "", "## Where the error comes from", "",
              "Median over configurations of each part of predicted - measured, as a share of "
              "the measured step (mean over timed steps): the busiest rank's compute, the rest "
              "of the span from the first action to the last (bubbles, transfers, overhead "
              "between actions), and the time before the first and after the last action "
              "(which the simulator does not have). Then the median |error| were each part "
              "predicted exactly.", "", *_sources(records), "",
              "By micro-batch count (at one micro-batch two ranks never compute at once, so "
              "the slowdown there is the compute's own, contention aside):", "",
              *_by_chunks(records), "",
              "Data parallelism: the gradient all-reduce over dp per step (the busiest "
              "process's, `pipe.data_parallel_stats()`) and what the step waited for it after "
              "its last action, medians over the configurations, against the planner's:", "",
              *_data_parallel(records), "",
              "The cost model's inputs measured again after the steps (the planner's are "
              "snapshots taken before them):", "", *_drift(records), "",
              "What three changes to the cost model's inputs would do, each fitted on half the "
              "configurations and scored (median |error|) on the other half, both ways round: "
              "the contention factor, then a cost per step and per compute action of the "
              "busiest rank, and the time model `fit_time_model` fits from the measured "
              "timelines (every term at once). The last column is the floor under any model: "
              "the median |error| of a configuration's median over the rounds against the "
              "same median of the rounds resampled.", "", *_what_if(records), ""]
    for r in records:
        lines += [*_fastest(r, top), ""]
    return "\n".join(lines)
