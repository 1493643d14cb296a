"""What planning returns: the plan and its candidates, or the error naming the least budget."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.errors import PipeConfigError
from pipeline.planner.costs import ModelProfile
from pipeline.planner.link import Link
from pipeline.planner.memory import format_bytes
from pipeline.planner.search import predict
from pipeline.planner.space import Candidate
from pipeline.planner.tensor import TensorSharding
from schedules import Timeline

if TYPE_CHECKING:
    from pipeline.planner.time_model import TimeModel
    from pipeline.planner.trials import Trials

__all__ = ["Plan", "PlanError", "format_table", "no_fit"]


class PlanError(PipeConfigError):
    """No configuration fits the memory budget; `minimum_bytes` is the least budget per rank
    that one would fit in, `candidates` what was tried."""

    def __init__(self, message: str, minimum_bytes: float,
                 candidates: tuple[Candidate, ...]) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.candidates = candidates


@dataclass(frozen=True)
class Plan:
    """What `plan()` chose and why. Times are seconds per `pipe.step`, bytes per pipeline rank
    (every data-parallel replica and tensor-parallel peer alike); `candidates` holds every
    configuration considered, the chosen one first. `Pipe(model, **plan.pipe_kwargs())`
    builds it. `tp` > 1: each stage is split over `tp` ranks of one host by `tp_plan`
    (`sharding`: what the planner took it to split; `host_link`: its collectives' link;
    `ranks_per_host`: ranks to a host). Planned with `trials=k`: `measured_step_time` and
    `measured_interval` (its 95% bootstrap interval over rounds) are the chosen one's measured
    step, `trials` every trial's measurements, `calibration` measured / predicted.
    `remembered`: what the memory of the last choice did (`pipeline.planner.remembered`; None
    when planned without it)."""

    balance: tuple[int, ...]
    schedule: str
    schedule_options: dict[str, int]
    chunks: int
    checkpoint: str
    dp: int
    pp: int
    microbatch_rows: int
    predicted_step_time: float
    predicted_peak_bytes: tuple[float, ...]
    predicted_activation_bytes: tuple[float, ...]
    predicted_allreduce_time: float
    memory_per_rank: tuple[float, ...]
    candidates: tuple[Candidate, ...]
    devices: tuple[str, ...] | None
    link: Link
    profile: ModelProfile
    contention: float = 1.0
    optimizer: tuple[float, int] = (2.0, 4)
    tp: int = 1
    tp_plan: Mapping[str, Any] | None = None
    sharding: TensorSharding | None = None
    host_link: Link | None = None
    ranks_per_host: int | None = None
    measured_step_time: float | None = None
    measured_interval: tuple[float, float] | None = None
    trials: Trials | None = None
    remembered: str | None = None

    @property
    def calibration(self) -> float | None:
        """The median over the trials of measured / predicted step (None without trials)."""
        return None if self.trials is None else self.trials.calibration

    @property
    def time_model(self) -> TimeModel | None:
        """The time model the trials' measured steps fit (None without trials, or when no
        trial was a plain pipeline): `plan(..., time_model=p.time_model)` prices the next
        plan as this machine ran these steps."""
        return None if self.trials is None else self.trials.time_model

    def calibrated_profile(self) -> ModelProfile:
        """The profile with every layer's seconds scaled by `calibration`, for the next
        `plan(..., profile=p.calibrated_profile(), link=p.link)`: predictions then match the
        trials' measured steps on average, the error put on compute (links stay as measured)."""
        from pipeline.planner.trials import scaled_profile

        if self.calibration is None:
            raise PipeConfigError("calibrated_profile needs measurements: plan with trials=k "
                                  "(k >= 1) to run the best predicted candidates first")
        return scaled_profile(self.profile, self.calibration)

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    @property
    def near_ties(self) -> list[Candidate]:
        """The candidates predicted within `ties.NEAR` of the fastest step, the chosen one
        first when the plan is by prediction (`pipeline.planner.ties`)."""
        from pipeline.planner.ties import near_ties

        return near_ties(self.candidates)

    @property
    def runner_up(self) -> Candidate | None:
        """The next fastest simulated candidate that fits and runs differently (another
        split, chunk count, shape or predicted step: at one micro-batch, gpipe and 1f1b are
        one schedule); None if there is none."""
        c0 = self.chosen

        def differs(c: Candidate) -> bool:
            return (c.balance != c0.balance or c.chunks != c0.chunks or c.dp != c0.dp
                    or c.tp != c0.tp or c.step_time != c0.step_time)

        found = next((c for c in self.candidates[1:] if c.status == "fits" and differs(c)),
                     None)
        if found is not None:
            return found
        # Every other candidate was pruned unsimulated: simulate the likeliest one alone.
        for c in sorted((c for c in self.candidates if c.status == "pruned"),
                        key=lambda c: c.lower_bound or math.inf):
            alone = predict(self.profile, self.link, schedule=c.schedule, chunks=c.chunks,
                            checkpoint=c.checkpoint, options=c.options, pp=c.pp, dp=c.dp,
                            contention=self.contention, optimizer=self.optimizer, tp=c.tp,
                            sharding=self.sharding, host_link=self.host_link,
                            ranks_per_host=self.ranks_per_host)
            if (alone.peak_bytes is not None and differs(alone) and all(
                    b <= m * (1 + 1e-12) for b, m in zip(alone.peak_bytes,
                                                          self.memory_per_rank, strict=False))):
                return alone
        return None

    @property
    def timeline(self) -> Timeline:
        """The chosen configuration's predicted timeline (seconds)."""
        return self.timeline_of(self.chosen)

    @staticmethod
    def timeline_of(candidate: Candidate) -> Timeline:
        """A simulated candidate's predicted timeline, in seconds, titled by its settings."""
        if candidate.timeline is None:
            raise ValueError(f"{candidate.label} was not simulated ({candidate.status})")
        t = candidate.timeline
        tp = f", tp {candidate.tp}" if candidate.tp > 1 else ""
        meta = {**t.meta, "predicted": True, "schedule": f"{candidate.label} (chunks "
                f"{candidate.chunks}, {candidate.checkpoint}, dp {candidate.dp}{tp})"}
        return Timeline(t.num_ranks, t.events, "s", meta)

    def pipe_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """`Pipe`'s arguments for this plan (with `overrides`, e.g. `mesh=` when dp or tp > 1;
        `tp_plan=` is passed through when tp > 1)."""
        kwargs: dict[str, Any] = {"balance": list(self.balance), "chunks": self.chunks,
                                  "schedule": self.schedule, "checkpoint": self.checkpoint}
        if self.devices is not None:
            kwargs["devices"] = list(self.devices)
        elif self.link.transport == "threads":
            kwargs["devices"] = ["cpu"] * self.pp
        if self.tp > 1 and self.tp_plan is not None:
            kwargs["tp_plan"] = dict(self.tp_plan)
        kwargs.update(overrides)
        if self.tp > 1 and "mesh" not in kwargs:
            flat = (f", or a 2-D one: init_device_mesh(device, ({self.pp}, {self.tp}), "
                    f"mesh_dim_names=('pp', 'tp'))" if self.dp == 1 else "")
            raise PipeConfigError(
                f"this plan runs {self.dp} data-parallel replica(s) of a {self.pp}-stage "
                f"pipeline, each stage split over {self.tp} tensor-parallel ranks of one host: "
                f"pass mesh=init_device_mesh(device, ({self.dp}, {self.pp}, {self.tp}), "
                f"mesh_dim_names=('dp', 'pp', 'tp')) to pipe_kwargs{flat}, and give each "
                f"replica 1/{self.dp} of the batch")
        if self.dp > 1 and "mesh" not in kwargs:
            raise PipeConfigError(
                f"this plan runs {self.dp} data-parallel replicas of a {self.pp}-rank pipeline: "
                f"pass mesh=init_device_mesh(device, ({self.dp}, {self.pp}), mesh_dim_names="
                f"('dp', 'pp')) to pipe_kwargs, and give each replica 1/{self.dp} of the batch")
        if self.tp > 1 and "tp_plan" not in kwargs:
            raise PipeConfigError(
                f"this plan splits each stage over {self.tp} tensor-parallel ranks but knows no "
                f"tp_plan (it was planned from a profile): pass tp_plan={{module-name pattern: "
                f"ParallelStyle}} to pipe_kwargs")
        return kwargs

    def _say_near_ties(self) -> list[str]:
        """A line naming the near ties, when there are several: the choice among them is by
        simplicity, not by the profile's noise."""
        from pipeline.planner.ties import NEAR

        near = self.near_ties
        if len(near) < 2:
            return []
        fastest = min(c.step_time for c in near if c.step_time is not None)
        return [f"near ties (within {NEAR:.0%} of the fastest, {fastest * 1e3:.2f} ms; the "
                f"simplest is chosen: fewer stages per rank, then chunks, then recomputation, "
                f"then a fixed schedule order): " + "; ".join(_tie(c) for c in near)]

    def table(self, limit: int | None = 20) -> str:
        """The candidates as a text table, best first (`limit` rows of them; None: all)."""
        return format_table(self.candidates, limit)

    def summary(self) -> str:
        c = self.chosen
        peaks = " / ".join(format_bytes(b) for b in self.predicted_peak_bytes)
        budget = " / ".join(sorted({format_bytes(b) for b in self.memory_per_rank}))
        lines = [
            f"plan: {c.label}, {c.shape}, chunks {self.chunks} ({self.microbatch_rows} rows "
            f"each), checkpoint {self.checkpoint!r}, balance {list(self.balance)}",
            f"predicted step {self.predicted_step_time * 1e3:.2f} ms"
            + (f" (all-reduce exposed {self.predicted_allreduce_time * 1e3:.2f} ms)"
               if self.dp > 1 else ""),
            f"predicted peak per rank {peaks} (budget {budget})",
            *self._say_near_ties(),
            *([self.remembered] if self.remembered else []),
            f"transfers over {self.link.transport}: {self.link.latency * 1e6:.1f} us + "
            f"{self.link.per_byte * 1e9:.3f} ns/byte; ranks computing at once are "
            f"{self.contention:.2f}x slower than alone",
        ]
        if self.sharding is not None:
            host = self.host_link or self.link
            lat = host.latency if host.collective_latency is None else host.collective_latency
            per = host.per_byte if host.collective_per_byte is None else host.collective_per_byte
            lines.append(f"tensor parallelism within hosts of {self.ranks_per_host} ranks; its "
                         f"all-reduces: 2(tp-1) x ({lat * 1e6:.1f} us + bytes/tp x "
                         f"{per * 1e9:.3f} ns/byte)")
        if self.trials is not None and self.measured_step_time is not None:
            lo, hi = self.measured_interval or (math.nan, math.nan)
            t = self.trials
            lines.insert(2, f"measured step {self.measured_step_time * 1e3:.2f} ms (95% "
                         f"interval {lo * 1e3:.2f} - {hi * 1e3:.2f} ms), the fastest of "
                         f"{len(t.trials)} trials over {len(t.orders)} rounds "
                         f"({t.seconds:.1f} s of trials); measured / predicted "
                         f"{t.calibration:.2f}")
        return "\n".join(lines)


def _tie(c: Candidate) -> str:
    from pipeline.planner.ties import named

    return named(c) + ("" if c.step_time is None else f" {c.step_time * 1e3:.2f} ms")


def format_table(candidates: Sequence[Candidate], limit: int | None = 20) -> str:
    """Candidates as aligned text: schedule, dp x pp x tp, chunks, checkpoint, balance,
    predicted step and largest rank's peak, verdict and why."""
    # A measured column only when trials ran, so a plain plan's table reads as it always has.
    measured = any(c.measured_step_time is not None for c in candidates)
    head: tuple[str, ...] = ("schedule", "dp x pp x tp", "chunks", "rows", "checkpoint",
                             "step ms", *(("measured ms",) if measured else ()), "peak",
                             "status", "balance / why")
    rows = [head]
    shown = list(candidates if limit is None else candidates[:limit])
    for c in shown:
        why = f"{list(c.balance)}" if c.balance and c.fits else ""
        if c.reason:
            why = f"{why} {c.reason}".strip()
        got = (f"{c.measured_step_time * 1e3:.2f}",) if c.measured_step_time is not None \
            else ("-",)
        rows.append((c.label, f"{c.dp} x {c.pp} x {c.tp}", str(c.chunks), str(c.rows),
                     c.checkpoint, f"{c.step_time * 1e3:.2f}" if c.step_time is not None
                     else "-", *(got if measured else ()),
                     format_bytes(max(c.peak_bytes)) if c.peak_bytes else "-", c.status, why))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  "
             + r[-1] for r in rows]
    left = len(candidates) - len(shown)
    if left:
        counts: dict[str, int] = {}
        for c in candidates[len(shown):]:
            counts[c.status] = counts.get(c.status, 0) + 1
        lines.append(f"... and {left} more: " + ", ".join(f"{n} {s}" for s, n in
                                                          sorted(counts.items())))
    return "\n".join(lines)


def no_fit(limits: tuple[float, ...], least: float, where: str,
           table: tuple[Candidate, ...]) -> PlanError:
    """The error when no candidate fits: the least budget that would, and where."""
    budget = " / ".join(sorted({f"{v:.0f} bytes ({format_bytes(v)})" for v in limits}))
    if math.isinf(least):
        reasons = sorted({c.reason for c in table})[:3]
        return PlanError(f"no configuration is possible: {'; '.join(reasons)}", least, table)
    need = math.ceil(least)
    return PlanError(
        f"no configuration fits memory_per_rank={budget} on every rank (parameters, "
        f"gradients, optimizer state and stashed activations, with recomputation and every "
        f"schedule tried): the smallest budget that fits is {need} bytes "
        f"({format_bytes(need)}) per rank ({where}); raise memory_per_rank to at least "
        f"that, use more ranks, or a smaller batch", need, table)
