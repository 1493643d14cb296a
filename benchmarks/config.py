"""What to measure: suites, the filters that narrow them, and the groups that run together."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipeline.examples.models import get_model
from schedules import info

__all__ = ["SUITES", "TRANSPORTS", "Group", "Suite", "fit_to_gpus", "groups", "narrow",
           "num_units", "stages_per_rank"]

TRANSPORTS = ("threads", "processes")
_ONE_RANK_SCHEDULES = ("gpipe", "1f1b")  # with one stage the others say nothing new


@dataclass(frozen=True)
class Suite:
    """Models x ranks x micro-batches x schedules x transports, and how long to time each."""

    name: str
    models: tuple[str, ...]
    ranks: tuple[int, ...]
    microbatches: Mapping[str, tuple[int, ...]]  # per model
    schedules: tuple[str, ...]
    transports: tuple[str, ...]
    warmup: int
    repeats: int
    balance_methods: tuple[str, ...] | None = None  # None: each model's own


SUITES: dict[str, Suite] = {
    # CI: a tiny model, a few steps; checks that everything runs and renders, not the numbers.
    "quick": Suite("quick", ("tiny",), (1, 2), {"tiny": (2, 4)},
                   ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"), TRANSPORTS,
                   warmup=1, repeats=3),
    # The numbers in benchmarks/README.md (about 20 minutes on 2 cores).
    "full": Suite("full", ("mlp", "transformer", "unbalanced"), (1, 2),
                  {"mlp": (1, 2, 4, 8, 16, 32), "transformer": (2, 4, 8, 16),
                   "unbalanced": (4, 8, 16)},
                  ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipe-v"),
                  TRANSPORTS, warmup=3, repeats=11),
    # Latency against bandwidth: the reference MLP and the same shape at width 32, where every
    # action is short and a step is a chain of messages (about 10 minutes on 2 cores).
    "latency": Suite("latency", ("mlp", "small"), (2,), {"mlp": (4, 8, 16), "small": (8, 32)},
                     ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"), ("processes",),
                     warmup=3, repeats=11),
}


@dataclass(frozen=True)
class Group:
    """Configurations measured together, step by step in turn, on one set of processes: one
    model, balance method and rank count; every transport, schedule and micro-batch count."""

    model: str
    balance_method: str
    num_ranks: int
    transports: tuple[str, ...]
    schedules: tuple[str, ...]
    microbatches: tuple[int, ...]
    warmup: int
    repeats: int
    device: str = "cpu"
    balances: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per schedule

    @property
    def name(self) -> str:
        return f"{self.model}/{self.balance_method}/p{self.num_ranks}"


def stages_per_rank(schedule: str) -> int:
    """Stages each rank holds under `schedule`: its generator's default (interleaved: two)."""
    return info(schedule).stages_per_rank


def _parse_list(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _parse_counts(text: str | None, flag: str, example: str) -> tuple[int, ...] | None:
    """A comma-separated list of whole numbers >= 1; an error names `flag` and the bad item."""
    if text is None:
        return None
    counts = []
    for item in (item.strip() for item in text.split(",")):
        if not item:
            continue
        # At most 9 digits: int() would refuse 4300 with an error that names no flag.
        if re.fullmatch(r"[0-9]{1,9}", item) is None or int(item) < 1:
            shown = text if len(text) <= 40 else f"{text[:20]}..."
            bad = "" if item == text.strip() else f": {item[:20]!r} is not one"
            raise ValueError(f"{flag} takes comma-separated whole numbers >= 1, e.g. "
                             f"{example} (got {shown!r}{bad})")
        counts.append(int(item))
    return tuple(counts)


def narrow(suite: Suite, *, models: str | None = None, ranks: str | None = None,
           microbatches: str | None = None, schedules: str | None = None,
           transports: str | None = None, warmup: int | None = None,
           repeats: int | None = None) -> Suite:
    """The suite with each given comma-separated filter replacing its list.

    Micro-batch counts given here apply to every model.
    """
    chosen_models = _parse_list(models) or suite.models
    for name in chosen_models:
        get_model(name)  # raises on an unknown name
    mb = _parse_counts(microbatches, "--microbatches", "4,8,16")
    per_model = {name: mb or suite.microbatches.get(name, (1, 2, 4, 8)) for name in chosen_models}
    chosen_transports = _parse_list(transports) or suite.transports
    bad = [t for t in chosen_transports if t not in TRANSPORTS]
    if bad:
        raise ValueError(f"unknown transport {bad[0]!r}; use {' or '.join(TRANSPORTS)}")
    chosen_ranks = _parse_counts(ranks, "--ranks", "1,2") or suite.ranks
    changed = replace(suite, models=chosen_models, ranks=chosen_ranks, microbatches=per_model,
                      schedules=_parse_list(schedules) or suite.schedules,
                      transports=chosen_transports)
    if warmup is not None:
        changed = replace(changed, warmup=warmup)
    if repeats is not None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1 (got {repeats})")
        changed = replace(changed, repeats=repeats)
    return changed


def groups(suite: Suite, *, device: str = "cpu") -> list[Group]:
    """The suite's groups, balances not yet filled in (see `harness.resolve_balances`).

    Skips what cannot run: more stages than layers, a micro-batch count above the batch size.
    One rank runs only gpipe and 1f1b, under the model's first balance method (with one
    stage every method gives the same partition).
    """
    out: list[Group] = []
    for name in suite.models:
        spec = get_model(name)
        num_layers = len(spec.build())
        methods = suite.balance_methods or spec.balance_methods
        mbs = tuple(m for m in suite.microbatches[name] if m <= spec.batch_size)
        for p in suite.ranks:
            chosen = tuple(s for s in suite.schedules
                           if (p > 1 or s in _ONE_RANK_SCHEDULES)
                           and p * stages_per_rank(s) <= num_layers)
            if not chosen or not mbs:
                continue
            for method in methods if p > 1 else methods[:1]:
                out.append(Group(name, method, p, suite.transports, chosen, mbs,
                                 suite.warmup, suite.repeats, device))
    return out


def fit_to_gpus(groups_: Sequence[Group], num_gpus: int) -> tuple[list[Group], list[str]]:
    """What `num_gpus` GPUs can run, and a note for each thing left out.

    One process per rank needs a GPU per rank (NCCL cannot put two ranks on one device), so
    groups with more ranks than GPUs keep only their threads pipeline, whose ranks share the
    GPUs (rank r on cuda:r mod num_gpus), beside the plain model; without a threads transport
    the group is skipped.
    """
    kept: list[Group] = []
    notes: list[str] = []
    for g in groups_:
        if g.num_ranks <= num_gpus or "processes" not in g.transports:
            kept.append(g)
            continue
        why = (f"{g.name}: one process per rank needs {g.num_ranks} GPUs and {num_gpus} "
               f"{'is' if num_gpus == 1 else 'are'} here")
        if "threads" in g.transports:
            kept.append(replace(g, transports=("threads",)))
            notes.append(f"{why}: the multi-process pipelines (ours and torch's) are skipped; "
                         f"the threads pipeline shares the GPU(s)")
        else:
            notes.append(f"{why}: skipped")
    return kept, notes


def num_units(groups_: Sequence[Group]) -> int:
    """How many (group, micro-batch count) units of progress the groups make."""
    return sum(len(g.microbatches) for g in groups_)
