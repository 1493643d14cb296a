"""The planning benchmark's figures: rank and regret with bootstrap intervals, prediction error."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.stats import comm_latency, idle_not_waiting
from pipeline.planner.intervals import interval, quantile
from schedules import Timeline

__all__ = ["Anatomy", "Standing", "anatomy", "bootstrap", "decompose", "error_summary",
           "interval", "noise", "quantile", "spearman", "standing"]

Times = Sequence[Sequence[float]]  # [configuration][round]: seconds per step in that round


@dataclass(frozen=True)
class Standing:
    """Where a configuration stands among the eligible ones: its rank (1: fastest; equal
    medians share a rank), its regret (its median / the best's - 1) and the best's index."""

    rank: int
    regret: float
    best: int


def _medians(times: Times, rounds: Sequence[int] | None = None) -> list[float]:
    if rounds is None:
        return [statistics.median(t) for t in times]
    return [statistics.median([t[r] for r in rounds]) for t in times]


def _standing(medians: Sequence[float], eligible: Sequence[bool], target: int) -> Standing:
    best = min((i for i, ok in enumerate(eligible) if ok), key=medians.__getitem__)
    faster = sum(1 for i, ok in enumerate(eligible)
                 if ok and i != target and medians[i] < medians[target])
    return Standing(1 + faster, medians[target] / medians[best] - 1, best)


def standing(times: Times, eligible: Sequence[bool], target: int,
             rounds: Sequence[int] | None = None) -> Standing:
    """`target`'s rank among the eligible configurations (itself counted whether eligible or
    not) and its regret against the fastest eligible one, by the median over `rounds` (all by
    default) of each configuration's per-round seconds."""
    if not any(eligible):
        raise ValueError("no configuration is eligible: nothing to rank against")
    return _standing(_medians(times, rounds), eligible, target)


def bootstrap(times: Times, eligible: Sequence[bool], targets: Sequence[int], *,
              replicates: int = 2000, seed: int = 0, level: float = 0.95) -> list[dict[str, Any]]:
    """For each target: percentile intervals of its rank and regret, and how often it was the
    fastest eligible, over `replicates` resamplings of the rounds (with replacement, the same
    rounds for every configuration: each round's turns shared the machine's state). The best
    is chosen afresh in every resample, so the intervals carry the doubt about which is best."""
    if not any(eligible):
        raise ValueError("no configuration is eligible: nothing to rank against")
    rounds = len(times[0])
    if any(len(t) != rounds for t in times):
        raise ValueError("every configuration needs the same rounds")
    rng = random.Random(seed)
    ranks: list[list[int]] = [[] for _ in targets]
    regrets: list[list[float]] = [[] for _ in targets]
    wins = [0] * len(targets)
    for _ in range(replicates):
        medians = _medians(times, [rng.randrange(rounds) for _ in range(rounds)])
        for j, t in enumerate(targets):
            s = _standing(medians, eligible, t)
            ranks[j].append(s.rank)
            regrets[j].append(s.regret)
            wins[j] += int(eligible[t] and s.rank == 1)
    return [{"rank_ci": list(interval([float(r) for r in ranks[j]], level)),
             "regret_ci": list(interval(regrets[j], level)),
             "p_best": wins[j] / replicates} for j in range(len(targets))]


def noise(times: Times) -> dict[str, float]:
    """How much a configuration's per-round seconds move between rounds: the coefficient of
    variation (stdev / mean) per configuration, its median and largest over configurations."""
    cvs = [statistics.stdev(t) / statistics.fmean(t) for t in times if len(t) > 1]
    if not cvs:
        return {"median_cv": math.nan, "max_cv": math.nan}
    return {"median_cv": statistics.median(cvs), "max_cv": max(cvs)}


def error_summary(errors: Sequence[float]) -> dict[str, Any]:
    """Signed prediction errors (predicted / measured - 1): the median absolute error, the
    quantiles of |error| and of the signed error, and the share within 5, 10 and 20%."""
    if not errors:
        return {"n": 0}
    absolute = [abs(e) for e in errors]
    qs = (0.1, 0.25, 0.5, 0.75, 0.9)
    return {"n": len(errors), "median_abs": statistics.median(absolute),
            "abs_quantiles": {str(q): quantile(absolute, q) for q in qs},
            "signed_quantiles": {str(q): quantile(errors, q) for q in qs},
            "within": {f"{p}%": sum(a <= p / 100 for a in absolute) / len(absolute)
                       for p in (5, 10, 20)},
            "under_predicted": sum(e < 0 for e in errors) / len(errors)}


@dataclass(frozen=True)
class Anatomy:
    """Where a step's seconds go: `step` (as timed), `span` (first action's start to the last
    one's end), `busy` (per rank, compute actions), `idle_ready` (the most a rank sat idle
    with its next action's input at hand: runtime overhead), `message_wait` (median delay from
    a producer's end to its consumer's start where the consumer waited), `actions` (compute
    actions per rank)."""

    step: float
    span: float
    busy: tuple[float, ...]
    idle_ready: float
    message_wait: float
    actions: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step, "span_s": self.span, "busy_s": list(self.busy),
                "idle_with_input_ready_s": self.idle_ready, "message_wait_s": self.message_wait,
                "compute_actions": list(self.actions)}


def anatomy(tl: Timeline, step: float | None = None) -> Anatomy:
    """A timeline's anatomy (measured: `step` is the timed step; predicted: its makespan)."""
    events = tl.events
    first = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=0.0) - first
    busy = tuple(tl.busy(r) for r in range(tl.num_ranks))
    actions = tuple(sum(1 for e in tl.lane(r) if e.action.is_compute)
                    for r in range(tl.num_ranks))
    return Anatomy(span if step is None else step, span, busy, idle_not_waiting(tl),
                   comm_latency([tl]), actions)


def decompose(predicted: Anatomy, measured: Anatomy) -> dict[str, float]:
    """The prediction's error in seconds, split so the parts add up to predicted - measured:
    `compute` (the busiest rank's compute, predicted - measured), `idle` (the rest of the
    span: bubbles, transfers, overhead between actions; predicted - measured) and `outside`
    (minus the measured time before the first action and after the last: the simulator has
    none)."""
    compute = max(predicted.busy) - max(measured.busy)
    idle = (predicted.span - max(predicted.busy)) - (measured.span - max(measured.busy))
    outside = -(measured.step - measured.span)
    return {"compute": compute, "idle": idle, "outside": outside,
            "total": predicted.step - measured.step}


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (ties at their mean rank)."""
    def ranks(xs: Sequence[float]) -> list[float]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(a) != len(b) or len(a) < 2:
        return math.nan
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var > 0 else math.nan
