"""`plan()`: the balance, schedule, micro-batches, recomputation and dp x pp for a memory budget."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

import schedules
from pipeline.errors import PipeConfigError
from pipeline.planner.costs import LossFn, ModelProfile, measure_contention, profile_model
from pipeline.planner.link import TRANSPORTS, Link, measure_link
from pipeline.planner.memory import format_bytes, optimizer_factor
from pipeline.planner.search import predict, search
from pipeline.planner.space import CHECKPOINTS, Candidate, Space
from pipeline.splitting.traced import SplitModel
from schedules import Timeline

__all__ = ["Plan", "PlanError", "format_bytes", "format_table", "plan"]


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
    (every data-parallel replica alike); `candidates` holds every configuration considered,
    the chosen one first. `Pipe(model, **plan.pipe_kwargs())` builds it."""

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

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    @property
    def runner_up(self) -> Candidate | None:
        """The next fastest simulated candidate that fits and runs differently (another
        split, chunk count or predicted step: at one micro-batch, gpipe and 1f1b are one
        schedule); None if there is none."""
        c0 = self.chosen

        def differs(c: Candidate) -> bool:
            return (c.balance != c0.balance or c.chunks != c0.chunks or c.dp != c0.dp
                    or c.step_time != c0.step_time)

        found = next((c for c in self.candidates[1:] if c.status == "fits" and differs(c)),
                     None)
        if found is not None:
            return found
        # Every other candidate was pruned unsimulated: simulate the likeliest one alone.
        for c in sorted((c for c in self.candidates if c.status == "pruned"),
                        key=lambda c: c.lower_bound or math.inf):
            alone = predict(self.profile, self.link, schedule=c.schedule, chunks=c.chunks,
                            checkpoint=c.checkpoint, options=c.options, pp=c.pp, dp=c.dp,
                            contention=self.contention, optimizer=self.optimizer)
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
        meta = {**t.meta, "predicted": True, "schedule": f"{candidate.label} (chunks "
                f"{candidate.chunks}, {candidate.checkpoint}, dp {candidate.dp})"}
        return Timeline(t.num_ranks, t.events, "s", meta)

    def pipe_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """`Pipe`'s arguments for this plan (with `overrides`, e.g. `mesh=` when dp > 1)."""
        kwargs: dict[str, Any] = {"balance": list(self.balance), "chunks": self.chunks,
                                  "schedule": self.schedule, "checkpoint": self.checkpoint}
        if self.devices is not None:
            kwargs["devices"] = list(self.devices)
        elif self.link.transport == "threads":
            kwargs["devices"] = ["cpu"] * self.pp
        kwargs.update(overrides)
        if self.dp > 1 and "mesh" not in kwargs:
            raise PipeConfigError(
                f"this plan runs {self.dp} data-parallel replicas of a {self.pp}-rank pipeline: "
                f"pass mesh=init_device_mesh(device, ({self.dp}, {self.pp}), mesh_dim_names="
                f"('dp', 'pp')) to pipe_kwargs, and give each replica 1/{self.dp} of the batch")
        return kwargs

    def table(self, limit: int | None = 20) -> str:
        """The candidates as a text table, best first (`limit` rows of them; None: all)."""
        return format_table(self.candidates, limit)

    def summary(self) -> str:
        c = self.chosen
        peaks = " / ".join(format_bytes(b) for b in self.predicted_peak_bytes)
        budget = " / ".join(sorted({format_bytes(b) for b in self.memory_per_rank}))
        lines = [
            f"plan: {c.label}, dp {self.dp} x pp {self.pp}, chunks {self.chunks} "
            f"({self.microbatch_rows} rows each), checkpoint {self.checkpoint!r}, balance "
            f"{list(self.balance)}",
            f"predicted step {self.predicted_step_time * 1e3:.2f} ms"
            + (f" (all-reduce exposed {self.predicted_allreduce_time * 1e3:.2f} ms)"
               if self.dp > 1 else ""),
            f"predicted peak per rank {peaks} (budget {budget})",
            f"transfers over {self.link.transport}: {self.link.latency * 1e6:.1f} us + "
            f"{self.link.per_byte * 1e9:.3f} ns/byte; ranks computing at once are "
            f"{self.contention:.2f}x slower than alone",
        ]
        return "\n".join(lines)


def format_table(candidates: Sequence[Candidate], limit: int | None = 20) -> str:
    """Candidates as aligned text: schedule, dp x pp, chunks, checkpoint, balance, predicted
    step and largest rank's peak, verdict and why."""
    head = ("schedule", "dp x pp", "chunks", "rows", "checkpoint", "step ms", "peak",
            "status", "balance / why")
    rows = [head]
    shown = list(candidates if limit is None else candidates[:limit])
    for c in shown:
        why = f"{list(c.balance)}" if c.balance and c.fits else ""
        if c.reason:
            why = f"{why} {c.reason}".strip()
        rows.append((c.label, f"{c.dp} x {c.pp}", str(c.chunks), str(c.rows), c.checkpoint,
                     f"{c.step_time * 1e3:.2f}" if c.step_time is not None else "-",
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


def _space(names: Sequence[str] | None, checkpoints: Sequence[str] | None,
           chunks: Sequence[int] | None, dps: Sequence[int], max_stages_per_rank: int) -> Space:
    known = schedules.available()
    chosen = list(known if names is None else names)
    unknown = [n for n in chosen if n not in known]
    if unknown or not chosen:
        raise PipeConfigError(f"schedules must name registered schedules (got {chosen}); "
                              f"known: {', '.join(known)}")
    variants: list[tuple[str, tuple[tuple[str, int], ...]]] = []
    for name in chosen:
        gen = schedules.info(name)
        opts: tuple[tuple[str, int], ...] = ()
        if gen.batches_option is not None:
            opts = ((gen.batches_option, 1),)  # one batch per step, as pipe.step runs it
        if gen.stages_option is not None:
            lo = gen.stages_per_rank
            variants += [(name, ((gen.stages_option, v), *opts))
                         for v in range(lo, max(lo, max_stages_per_rank) + 1)]
        else:
            variants.append((name, opts))
    modes = tuple(checkpoints or CHECKPOINTS)
    if any(m not in CHECKPOINTS for m in modes):
        raise PipeConfigError(f"checkpoints must be among {CHECKPOINTS} (got {list(modes)})")
    if chunks is not None and (not chunks or any(not isinstance(m, int) or m < 1
                                                 for m in chunks)):
        raise PipeConfigError(f"chunks must be whole numbers >= 1 (got {chunks!r})")
    return Space(tuple(variants), modes, tuple(dps), tuple(chunks) if chunks else None)


def _limits(memory_per_rank: float | Sequence[float] | None, ranks: int) -> tuple[float, ...]:
    if memory_per_rank is None:
        return (math.inf,) * ranks
    if isinstance(memory_per_rank, int | float):
        values = [float(memory_per_rank)] * ranks
    else:
        values = [float(v) for v in memory_per_rank]
    if len(values) != ranks or any(not v > 0 for v in values):
        raise PipeConfigError(f"memory_per_rank must be a number of bytes > 0 (or one per "
                              f"rank, {ranks} of them; None: unbounded), got {memory_per_rank!r}")
    return tuple(values)


def plan(model: nn.Sequential, sample: Any, target: Any, loss_fn: LossFn, *, ranks: int,
         memory_per_rank: float | Sequence[float] | None, devices: Sequence[str] | None = None,
         schedules: Sequence[str] | None = None, optimizer: str | float = "adam",
         transport: str = "threads", link: Link | None = None,
         profile: ModelProfile | None = None, chunks: Sequence[int] | None = None,
         checkpoints: Sequence[str] | None = None, data_parallel: Sequence[int] | None = None,
         max_stages_per_rank: int = 4, repeats: int = 3,
         contention: float | None = None) -> Plan:
    """Choose how to pipeline `model` over `ranks` ranks within `memory_per_rank` bytes each.

    `sample` and `target` are one (global) batch, `loss_fn` the loss. A `SplitModel` (see
    `pipeline.split`, e.g. at every block) is planned as its pieces, its sample given as the
    model takes it. Every registered schedule
    (or those named in `schedules`), each checkpoint mode, each dp x pp factorisation of
    `ranks` (`transport` "gloo" or "nccl"; threads run one pipeline) and each micro-batch
    count is a candidate; see `pipeline.planner.search` for how the search is exact or
    pruned. Costs come from profiling the model where it lives (`profile_model`) and from
    measuring the transport (`measure_link`) and, when the ranks are CPUs, how much ranks
    computing at once slow each other (`measure_contention`); pass `profile`, `link` or
    `contention` to reuse measurements.
    Raises `PlanError` (a `ValueError`) naming the smallest budget that would fit when no
    candidate fits.
    """
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise PipeConfigError(f"plan takes a non-empty nn.Sequential (got "
                              f"{type(model).__name__})")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PipeConfigError(f"ranks must be an int >= 1 (got {ranks!r})")
    if isinstance(model, SplitModel):  # pieces of a model split at its blocks
        sample, loss_fn = model.flatten(sample), model.with_outputs(loss_fn, "train")
    if transport not in TRANSPORTS:
        raise PipeConfigError(f"transport must be one of {TRANSPORTS} (got {transport!r})")
    limits = _limits(memory_per_rank, ranks)
    factor = optimizer_factor(optimizer)
    if data_parallel is None:
        dps = [d for d in range(1, ranks + 1) if ranks % d == 0] if transport != "threads" \
            else [1]
    else:
        dps = list(data_parallel)
        if transport == "threads" and dps != [1]:
            raise PipeConfigError("data parallelism runs one process per rank: use transport="
                                  "'gloo' or 'nccl' for data_parallel > 1 (threads: [1])")
    if devices is not None and transport == "threads" and len(devices) != ranks:
        raise PipeConfigError(f"give one device per rank: {ranks} ranks, {len(devices)} "
                              f"devices {list(devices)}")
    space = _space(schedules, checkpoints, chunks, dps, max_stages_per_rank)
    if profile is None:
        batch = _batch_rows(sample)
        sizes = {-(-(batch // d) // m) for d in dps if batch % d == 0 and ranks % d == 0
                 for m in space.chunk_counts(batch // d, ranks // d)}
        profile = profile_model(model, sample, target, loss_fn, rows=sorted(sizes),
                                repeats=repeats)
    if link is None:
        pair = list(devices[:2]) if devices is not None and len(devices) > 1 else ["cpu", "cpu"]
        link = measure_link(transport, devices=pair)
    if contention is None:
        on_cpu = devices is None or all(str(d).startswith("cpu") for d in devices)
        contention = (measure_contention(model, sample, ranks=ranks)
                      if on_cpu and ranks > 1 and sample is not None else 1.0)
    if not contention >= 1.0:
        raise PipeConfigError(f"contention must be a number >= 1 (got {contention!r})")
    table, least, where = search(profile, link, ranks=ranks, limits=limits,
                                 optimizer=factor, space=space, contention=contention)
    chosen = table[0] if table else None
    if chosen is None or chosen.status != "chosen":
        raise _no_fit(limits, least, where, tuple(table))
    assert chosen.balance is not None and chosen.step_time is not None
    assert chosen.peak_bytes is not None and chosen.activation_bytes is not None
    return Plan(chosen.balance, chosen.schedule, dict(chosen.options), chosen.chunks,
                chosen.checkpoint, chosen.dp, chosen.pp, chosen.rows, chosen.step_time,
                chosen.peak_bytes, chosen.activation_bytes, chosen.allreduce_time, limits,
                tuple(table),
                tuple(str(d) for d in devices) if devices is not None else None, link,
                profile, contention, factor)


def _batch_rows(sample: Any) -> int:
    from pipeline.runtime.microbatch import leading_rows

    rows = leading_rows(sample)
    if rows is None:
        raise PipeConfigError("sample holds no tensor with a batch dimension (dim 0): pass "
                              "one batch of the model's input")
    return rows


def _no_fit(limits: tuple[float, ...], least: float, where: str,
            table: tuple[Candidate, ...]) -> PlanError:
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

