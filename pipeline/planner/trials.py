"""Trials: the best predicted candidates run in interleaved rounds; the measured fastest wins.

`plan(..., trials=k)` runs the k best predicted candidates a few steps each, where they will
run. Each candidate's turn builds a `Pipe` on a deep copy of the model (so the trials neither train
nor touch the caller's model), takes `warmup` untimed steps (the program is built, buffers are
allocated) and `steps` timed ones. Every round gives every candidate one turn, in an order
shuffled anew each round (seeded, so every process takes the same), so that the machine's drift
falls on all of them alike. A candidate's time is the median over rounds of its per-round
median step, with a bootstrap interval over rounds. With processes (`transport` "gloo" or
"nccl") `plan` is called on every rank of the launched group: rank 0's candidates are run by
all, each timed step starts at a barrier, and a step's time is the slowest rank's.

The trials' measured timelines then fit a time model (`pipeline.planner.time_model`; rank 0's
over processes), which prices every candidate that fits again. Those of its k best not yet run
take a second stage of rounds beside the first stage's fastest, and the plan is that stage's
measured fastest: a candidate the profile alone mispriced (a runtime cost per action it does
not hold, say) is still measured before the choice.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from pipeline.errors import PipeConfigError, PipelineError, PipeTypeError
from pipeline.planner.costs import LayerCosts, LossFn, ModelProfile
from pipeline.planner.intervals import median_interval
from pipeline.planner.result import Plan
from pipeline.planner.search import predict
from pipeline.planner.space import Candidate
from pipeline.planner.time_model import Sample, TimeModel, fit_time_model
from schedules import Timeline

__all__ = ["Trial", "Trials", "check_trials", "chosen_as", "contenders", "repriced",
           "run_trials", "scaled_profile"]

_SEED = 0  # the rounds' orders: fixed, so every process of a launch takes the same turns


@dataclass(frozen=True)
class Trial:
    """One candidate as measured: `times[r]` holds round r's timed steps (seconds each)."""

    candidate: Candidate
    times: tuple[tuple[float, ...], ...]
    interval: tuple[float, float]

    @property
    def predicted(self) -> float:
        assert self.candidate.step_time is not None
        return self.candidate.step_time

    @property
    def per_round(self) -> tuple[float, ...]:
        """Each round's median step."""
        return tuple(statistics.median(r) for r in self.times)

    @property
    def median(self) -> float:
        """The measured step: the median over rounds of each round's median step."""
        return statistics.median(self.per_round)

    @property
    def ratio(self) -> float:
        """Measured / predicted step."""
        return self.median / self.predicted


@dataclass(frozen=True)
class Trials:
    """The trials of one plan: `trials` in the order predicted (best first), `orders[r]` the
    order (indices into `trials`) their turns took in round r, `warmup` and `steps` per turn,
    `seconds`, the wall time of them all, and `time_model`, fitted from their measured
    timelines (`fit_time_model`, under dp the first replica's beside the others' compute, the
    all-reduce included; None when every trial split stages over tp).
    When that model ranked candidates not yet run among the k best, they ran in a second
    stage beside the first stage's fastest: `trials` are that stage's, `screened` the
    first's. `failed`: each candidate whose turn failed (out of memory, say) and the failure;
    it took no further turn and is not chosen."""

    trials: tuple[Trial, ...]
    orders: tuple[tuple[int, ...], ...]
    warmup: int
    steps: int
    seconds: float
    time_model: TimeModel | None = None
    screened: tuple[Trial, ...] = ()
    failed: tuple[tuple[Candidate, str], ...] = ()

    @property
    def fastest(self) -> int:
        """The index of the measured fastest (the better predicted one on a tie)."""
        return min(range(len(self.trials)), key=lambda i: (self.trials[i].median, i))

    @property
    def calibration(self) -> float:
        """Median over trials of measured / predicted step: > 1 when the model predicts fast."""
        return statistics.median(t.ratio for t in self.trials)

    def table(self) -> str:
        """The trials as text, in predicted order, the measured fastest marked."""
        rows = [("schedule", "chunks", "checkpoint", "dp x pp x tp", "predicted ms",
                 "measured ms", "95% interval ms", "measured/predicted")]
        for i, t in enumerate(self.trials):
            c, (lo, hi) = t.candidate, t.interval
            rows.append((c.label + (" *" if i == self.fastest else ""), str(c.chunks),
                         c.checkpoint, f"{c.dp} x {c.pp} x {c.tp}", f"{t.predicted * 1e3:.2f}",
                         f"{t.median * 1e3:.2f}", f"{lo * 1e3:.2f} - {hi * 1e3:.2f}",
                         f"{t.ratio:.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                 for r in rows]
        lines += [f"{c.label} m={c.chunks} {c.checkpoint} dp {c.dp}: failed, {why}"
                  for c, why in self.failed]
        lines.append(f"{len(self.orders)} rounds, each candidate {self.warmup} warm-up + "
                     f"{self.steps} timed steps a round, in a shuffled order; "
                     f"{self.seconds:.1f} s in all; * measured fastest")
        return "\n".join(lines)


def _count(name: str, value: Any, least: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PipeTypeError(f"{name} must be an int >= {least}, {what} (got {value!r}, a "
                            f"{type(value).__name__}); e.g. {name}={max(least, 3)}")
    if value < least:
        raise PipeConfigError(f"{name} must be an int >= {least}, {what} (got {value}); "
                              f"e.g. {name}={max(least, 3)}")
    return value


def check_trials(trials: int | None, rounds: int, steps: int, warmup: int
                 ) -> tuple[int, int, int, int]:
    """The trial settings checked: (trials, rounds, steps, warmup); `trials` None is 0."""
    k = _count("trials", 0 if trials is None else trials, 0,
               "the number of best predicted candidates to run and choose from by measurement "
               "(0: choose by prediction alone)")
    return (k, _count("trial_rounds", rounds, 2, "the rounds every trial takes a turn in "
                      "(two at least, for an interval)"),
            _count("trial_steps", steps, 1, "the timed steps of a turn"),
            _count("trial_warmup", warmup, 0, "the untimed steps before a turn's timed ones"))


def _key(c: Candidate) -> tuple[Any, ...]:
    return (c.schedule, c.options, c.dp, c.pp, c.chunks, c.rows, c.checkpoint, c.tp)


def contenders(p: Plan, k: int) -> list[Candidate]:
    """The k best predicted candidates that fit: those simulated, then, if fewer, those the
    search pruned unsimulated, simulated alone (least lower bound first; kept if they fit)."""
    out = [c for c in p.candidates if c.status in ("chosen", "fits")][:k]
    for c in sorted((c for c in p.candidates if c.status == "pruned"),
                    key=lambda c: c.lower_bound or float("inf")):
        if len(out) >= k:
            break
        alone = _predict(p, c, None, contention=p.contention)
        if _fits(p, alone):
            out.append(replace(alone, reason="pruned by the search; simulated alone for trials"))
    return sorted(out, key=lambda c: (c.step_time, out.index(c)))


def _predict(p: Plan, c: Candidate, balance: Sequence[int] | None, **how: Any) -> Candidate:
    """`c` predicted alone with `p`'s profile, links and optimizer, at `balance` (None: the
    min-max split); `how`: the contention or a time model."""
    return predict(p.profile, p.link, schedule=c.schedule, chunks=c.chunks,
                   checkpoint=c.checkpoint, balance=balance, options=c.options, pp=c.pp,
                   dp=c.dp, tp=c.tp, optimizer=p.optimizer, sharding=p.sharding,
                   host_link=p.host_link, ranks_per_host=p.ranks_per_host, **how)


def _fits(p: Plan, c: Candidate) -> bool:
    assert c.peak_bytes is not None
    return all(b <= m * (1 + 1e-12) for b, m in zip(c.peak_bytes, p.memory_per_rank,
                                                    strict=False))


def chosen_as(p: Plan, c: Candidate, **fields: Any) -> Plan:
    """`p` with `c` as its choice (its settings and predictions) and `fields` replaced."""
    assert c.balance is not None and c.step_time is not None
    assert c.peak_bytes is not None and c.activation_bytes is not None
    return replace(p, balance=c.balance, schedule=c.schedule, schedule_options=dict(c.options),
                   chunks=c.chunks, checkpoint=c.checkpoint, dp=c.dp, pp=c.pp,
                   microbatch_rows=c.rows, predicted_step_time=c.step_time,
                   predicted_peak_bytes=c.peak_bytes, predicted_activation_bytes=c.activation_bytes,
                   predicted_allreduce_time=c.allreduce_time, tp=c.tp, **fields)


def _with_trials(p: Plan, found: Trials) -> Plan:
    """`p` choosing the measured fastest: the trials first (that one "chosen", the others
    "fits", each with its measurement), then the rest of the table as it was."""
    measured = {}
    for i, t in enumerate(found.trials):
        measured[_key(t.candidate)] = replace(
            t.candidate, status="chosen" if i == found.fastest else "fits",
            measured_step_time=t.median, measured_interval=t.interval)
    first = sorted(measured.values(), key=lambda c: (c.status != "chosen", c.measured_step_time))
    failed = {_key(c): why for c, why in found.failed}
    rest = [replace(c, status="impossible", reason=f"failed in trials: {failed[_key(c)]}")
            if _key(c) in failed else c if c.status != "chosen" else replace(c, status="fits")
            for c in p.candidates if _key(c) not in measured]
    winner = first[0]
    return chosen_as(p, winner, candidates=(*first, *rest),
                     measured_step_time=winner.measured_step_time,
                     measured_interval=winner.measured_interval, trials=found)


def scaled_profile(profile: ModelProfile, factor: float) -> ModelProfile:
    """`profile` with every layer's compute seconds multiplied by `factor` (bytes unchanged)."""
    if not factor > 0:
        raise PipeConfigError(f"a profile's seconds scale by a factor > 0 (got {factor!r})")

    def scaled(c: LayerCosts) -> LayerCosts:
        return replace(c, forward=tuple(v * factor for v in c.forward),
                       backward=tuple(v * factor for v in c.backward),
                       backward_input=tuple(v * factor for v in c.backward_input),
                       backward_weight=tuple(v * factor for v in c.backward_weight))

    return replace(profile, by_rows={r: scaled(c) for r, c in profile.by_rows.items()},
                   _static={})


def run_trials(p: Plan, model: nn.Module, sample: Any, target: Any, loss_fn: LossFn, *,
               k: int, rounds: int, steps: int, warmup: int, transport: str) -> Plan:
    """Run the k best predicted candidates of `p` (see the module's docstring), then, priced
    again by the time model their timelines fit, the k best of those not yet run beside the
    measured fastest so far; return the plan of the measured fastest of that last stage,
    carrying every trial's measurements."""
    from pipeline.planner import trial_runs  # the runtime, only when trials run

    runner = trial_runs.Runner(p, model, sample, target, loss_fn, transport)
    began = time.perf_counter()
    failed: list[tuple[Candidate, str]] = []
    with runner.isolated():
        first = _stage(runner, runner.agree(contenders(p, k)), rounds, warmup, steps, failed)
        fitted = runner.shared(_fit(p, runner.timelines()))
        tried = {_key(c) for c in (*(t.candidate for t in first[0]), *(c for c, _ in failed))}
        # Rank 0's: each rank prices with its own profile, and all must run the same stage.
        more = runner.shared([c for c in repriced(p, fitted)[:k] if _key(c) not in tried]
                             if fitted else [])
        screened: tuple[Trial, ...] = ()
        if more:
            best = min(first[0], key=lambda t: t.median)  # the better predicted on a tie
            screened = first[0]
            first = _stage(runner, runner.agree([best.candidate, *more]), rounds, warmup, steps,
                           failed)
            fitted = runner.shared(_fit(p, runner.timelines()))
    trials, orders = first
    return _with_trials(p, Trials(trials, orders, warmup, steps, time.perf_counter() - began,
                                  fitted, screened, tuple(failed)))


def _stage(runner: Any, chosen: list[Candidate], rounds: int, warmup: int, steps: int,
           failed: list[tuple[Candidate, str]]
           ) -> tuple[tuple[Trial, ...], tuple[tuple[int, ...], ...]]:
    """`chosen` measured in `rounds` interleaved rounds (each round's order shuffled); a
    candidate whose turn fails takes no further turn and goes to `failed` with its failure."""
    orders: list[tuple[int, ...]] = []
    for r in range(rounds):
        shuffled = list(range(len(chosen)))
        random.Random(_SEED * 100_003 + r).shuffle(shuffled)
        orders.append(tuple(shuffled))
    times: list[list[list[float]]] = [[[math.nan] * steps for _ in range(rounds)] for _ in chosen]
    lost: dict[int, str] = {}
    for r, order in enumerate(orders):
        for i in order:
            if i not in lost:
                got = runner.turn(chosen[i], warmup, steps)
                if isinstance(got, str):
                    lost[i] = got
                else:
                    times[i][r] = got
    failed += [(chosen[i], why) for i, why in sorted(lost.items())]
    kept = [i for i in range(len(chosen)) if i not in lost]
    if not kept:
        raise PipelineError("plan(..., trials=k): every candidate's trial failed (" + "; ".join(
            f"{c.label} m={c.chunks}: {why}" for c, why in failed) + "); plan with trials=0, "
            "or mend what fails")
    times = runner.slowest(times)  # every rank took the same turns, the failed ones too
    trials = tuple(Trial(chosen[i], tuple(tuple(s) for s in times[i]),
                         median_interval([statistics.median(s) for s in times[i]]))
                   for i in kept)
    index = {i: j for j, i in enumerate(kept)}  # orders count among the kept trials
    return trials, tuple(tuple(index[i] for i in order if i in index) for order in orders)


def repriced(p: Plan, model: TimeModel) -> list[Candidate]:
    """Every candidate that fits, simulated or pruned by the search, predicted again by
    `model` (a simulated one keeps its split; a pruned one takes the min-max split), fastest
    first."""
    out = [got for c in p.candidates if c.status in ("chosen", "fits", "pruned")
           if _fits(p, got := _predict(p, c, c.balance if c.status != "pruned" else None,
                                       time_model=model))]
    return sorted(out, key=lambda c: (c.step_time, out.index(c)))


def _fit(p: Plan, steps: list[tuple[Candidate, float, Timeline, tuple[tuple[float, float], ...]]]
         ) -> TimeModel | None:
    """A time model from the trials' measured steps, each beside its candidate's prediction
    with no contention (what the model's terms are fitted against)."""
    if not steps:
        return None
    alone: dict[tuple[Any, ...], Timeline] = {}
    for c, _, _, _ in steps:
        if _key(c) not in alone:
            got = _predict(p, c, c.balance).timeline
            assert got is not None
            alone[_key(c)] = got
    return fit_time_model(Sample(tl, alone[_key(c)], s, beside, c.rows)
                          for c, s, tl, beside in steps)
