"""What the planning benchmark measures: the planner's space, balances around splits, dp x pp."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import schedules
from pipeline.planner import Candidate, Link, ModelProfile, Plan, TimeModel, predict

__all__ = ["Config", "Entry", "Predictor", "allreduce_seconds", "balance_neighbours",
           "build_space", "dedupe", "from_candidate", "index_of", "predictor"]


@dataclass(frozen=True)
class Config:
    """One way to run a step: schedule (name, options), micro-batches per replica,
    recomputation, layers per stage, and `dp` replicas of a `pp`-rank pipeline."""

    schedule: str
    options: tuple[tuple[str, int], ...]
    chunks: int
    checkpoint: str
    balance: tuple[int, ...]
    dp: int = 1
    pp: int = 2

    @property
    def key(self) -> str:
        """A readable unique name, e.g. `interleaved stages_per_rank=2 m=4 never [2, 3, 2, 2]`;
        ` dp=2` is added when replicas run beside each other."""
        # num_batches=1 is what pipe.step runs for 2BW: always the same, so not worth showing.
        extra = "".join(f" {k}={v}" for k, v in self.options if k != "num_batches")
        dp = f" dp={self.dp}" if self.dp > 1 else ""
        return f"{self.schedule}{extra} m={self.chunks} {self.checkpoint} {list(self.balance)}{dp}"

    def program(self) -> tuple[Any, ...]:
        """What the runtime executes: two configurations with the same program (at one
        micro-batch gpipe and 1f1b are one schedule; except_last then recomputes nothing) are
        one configuration, measured once."""
        order = _schedule(self.schedule, self.pp, self.chunks, self.options)
        recompute = "never" if self.checkpoint == "except_last" and self.chunks == 1 \
            else self.checkpoint
        return (order.actions, order.num_stages, recompute, self.balance, self.dp)


@functools.lru_cache(maxsize=1024)
def _schedule(name: str, pp: int, chunks: int, options: tuple[tuple[str, int], ...]
              ) -> schedules.Schedule:
    return schedules.get_schedule(name, pp, chunks, **dict(options))


def from_candidate(c: Candidate) -> Config:
    if c.balance is None:
        raise ValueError(f"{c.label} has no balance ({c.status}): predict it first")
    return Config(c.schedule, tuple(c.options), c.chunks, c.checkpoint, tuple(c.balance),
                  c.dp, c.pp)


# (config, contention[, time model]) -> its prediction
Predictor = Callable[..., Candidate]


def predictor(profile: ModelProfile, link: Link) -> Predictor:
    """The planner's prediction of any configuration, at a given contention factor (or by a
    fitted time model, whose contention it then takes)."""
    def run(c: Config, contention: float, time_model: TimeModel | None = None) -> Candidate:
        return predict(profile, link, schedule=c.schedule, chunks=c.chunks,
                       checkpoint=c.checkpoint, balance=c.balance, options=c.options, dp=c.dp,
                       pp=c.pp, contention=contention, time_model=time_model)
    return run


def allreduce_seconds(profile: ModelProfile, link: Link, c: Config) -> float:
    """The planner's time for a rank's dp all-reduces, the busiest rank's: each of its stages'
    trainable bytes reduced over dp (`Link.allreduce`), in sequence; 0 without dp."""
    if c.dp == 1:
        return 0.0
    edges = [0]
    for b in c.balance:
        edges.append(edges[-1] + b)
    order = _schedule(c.schedule, c.pp, c.chunks, c.options)
    return max(sum(link.allreduce(profile.static_bytes(edges[s], edges[s + 1])[1], c.dp)
                   for s in order.stages_of(r)) for r in range(c.pp))


def balance_neighbours(balance: Sequence[int]) -> list[tuple[int, ...]]:
    """Every split one layer away: across each boundary, one layer moved either way (no stage
    left empty)."""
    out: list[tuple[int, ...]] = []
    for i in range(len(balance) - 1):
        for step in (1, -1):  # to the later stage, to the earlier one
            b = list(balance)
            b[i] -= step
            b[i + 1] += step
            if min(b) >= 1:
                out.append(tuple(b))
    return out


@dataclass
class Entry:
    """A configuration to measure and why it is in the set (`origins`: "plan:<budget>",
    "default", "space:<budget>", "balance of <key>"), and the other configurations
    that run the same program (`aliases`, measured as this one)."""

    config: Config
    origins: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)


def dedupe(found: Iterable[tuple[Config, str]]) -> list[Entry]:
    """One entry per program, in first-seen order; each keeps every origin and alias."""
    entries: dict[tuple[Any, ...], Entry] = {}
    for config, origin in found:
        program = config.program()
        entry = entries.setdefault(program, Entry(config))
        if origin not in entry.origins:
            entry.origins.append(origin)
        if config != entry.config and config.key not in entry.aliases:
            entry.aliases.append(config.key)
    return list(entries.values())


def index_of(entries: Sequence[Entry], config: Config) -> int:
    """The entry that measures `config`: itself, or the one running the same program."""
    program = config.program()
    for i, entry in enumerate(entries):
        if entry.config.program() == program:
            return i
    raise KeyError(f"{config.key} is not among the configurations measured")


def _fitting(p: Plan, budget: float, predicted: Callable[[Candidate], Candidate]
             ) -> list[Candidate]:
    """Every candidate of the plan's table that is predicted to fit `budget`, best first
    (a pruned one is predicted on its own, with the split the planner gives it)."""
    out: list[Candidate] = []
    for c in p.candidates:
        if c.status in ("chosen", "fits"):
            out.append(c)
        elif c.status == "pruned":
            alone = predicted(c)
            if alone.peak_bytes is not None and max(alone.peak_bytes) <= budget:
                out.append(alone)
    return sorted(out, key=lambda c: c.step_time if c.step_time is not None else float("inf"))


def build_space(plans: Mapping[str, Plan], budgets: Mapping[str, float], default: Config, *,
                vary: int, contention: float, profile: ModelProfile,
                link: Link) -> list[Entry]:
    """Under each budget: the plan, every configuration of its table predicted to fit, and the
    balances one layer away from the splits of its `vary` predicted-fastest distinct
    configurations (the plan's first); and the default configuration. Deduplicated by
    program."""
    def alone(c: Candidate) -> Candidate:
        return predict(profile, link, schedule=c.schedule, chunks=c.chunks,
                       checkpoint=c.checkpoint, options=c.options, pp=c.pp, dp=c.dp,
                       contention=contention)

    found: list[tuple[Config, str]] = [(default, "default")]
    for name, p in plans.items():
        found.append((from_candidate(p.chosen), f"plan:{name}"))
        fitting = [from_candidate(c) for c in _fitting(p, budgets[name], alone)]
        found += [(c, f"space:{name}") for c in fitting]
        tops: list[Config] = []
        seen: set[tuple[Any, ...]] = set()
        for c in [from_candidate(p.chosen), *fitting]:
            if len(tops) >= vary:
                break
            if c.program() not in seen:
                seen.add(c.program())
                tops.append(c)
        for c in tops:
            found += [(Config(c.schedule, c.options, c.chunks, c.checkpoint, b, c.dp, c.pp),
                       f"balance of {c.key}") for b in balance_neighbours(c.balance)]
    return dedupe(found)
