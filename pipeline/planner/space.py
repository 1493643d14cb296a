"""The candidates a plan is chosen from: the space searched, and one configuration's verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

from schedules import Timeline

__all__ = ["CHECKPOINTS", "Candidate", "Configuration", "Space"]

CHECKPOINTS = ("never", "except_last", "always")


@dataclass(frozen=True)
class Space:
    """What to consider: schedules (name, options), checkpoint modes, data-parallel sizes,
    tensor-parallel sizes and, per replica, micro-batch counts (None: powers of two up to 64
    and 1..4 times pp) or, instead, micro-batch sizes (`microbatch_rows`: the counts that
    split a replica's rows into micro-batches of exactly those sizes)."""

    schedules: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    checkpoints: tuple[str, ...] = CHECKPOINTS
    dps: tuple[int, ...] = (1,)
    chunks: tuple[int, ...] | None = None
    tps: tuple[int, ...] = (1,)
    microbatch_rows: tuple[int, ...] | None = None

    def chunk_counts(self, rows: int, pp: int) -> tuple[int, ...]:
        if self.microbatch_rows is not None:
            return tuple(sorted({rows // b for b in self.microbatch_rows
                                 if b <= rows and rows % b == 0}))
        if self.chunks is not None:
            return tuple(sorted({m for m in self.chunks if m <= rows}))
        powers = {1 << i for i in range(7)}
        return tuple(sorted(m for m in powers | {pp * j for j in range(1, 5)} if m <= rows))


@dataclass(frozen=True)
class Configuration:
    """One point of the space: a schedule (name, options), dp x pp x tp, micro-batches per
    replica and rows per micro-batch, and the recomputation mode. `tp` is keyword-only and 1
    unless tensor parallelism was searched."""

    schedule: str
    options: tuple[tuple[str, int], ...]
    dp: int
    pp: int
    chunks: int
    rows: int
    checkpoint: str
    tp: int = field(default=1, kw_only=True)

    @property
    def shape(self) -> str:
        """'dp 2 x pp 4 x tp 8'."""
        return f"dp {self.dp} x pp {self.pp} x tp {self.tp}"

    @property
    def label(self) -> str:
        opts = "".join(f" {k}={v}" for k, v in self.options)
        return f"{self.schedule}{opts}"


@dataclass(frozen=True)
class Candidate(Configuration):
    """One configuration and what the search found. `status`: "chosen", "fits" (simulated),
    "pruned" (its lower bound is no faster than the chosen step), "over budget", "impossible".
    Times are seconds per step, bytes are per pipeline rank. A candidate run by `plan(...,
    trials=k)` carries its measured median step and that median's 95% interval."""

    status: str
    reason: str
    balance: tuple[int, ...] | None = None
    step_time: float | None = None
    lower_bound: float | None = None
    peak_bytes: tuple[float, ...] | None = None
    activation_bytes: tuple[float, ...] | None = None
    allreduce_time: float = 0.0
    measured_step_time: float | None = None
    measured_interval: tuple[float, float] | None = None
    timeline: Timeline | None = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return self.status in ("chosen", "fits", "pruned")
