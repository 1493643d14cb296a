"""`plan()`: the balance, schedule, micro-batches, recomputation and dp x pp x tp for a budget."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

import schedules
from pipeline.errors import PipeConfigError
from pipeline.planner.costs import LossFn, ModelProfile, measure_contention, profile_model
from pipeline.planner.link import TRANSPORTS, Link, measure_link
from pipeline.planner.memory import format_bytes, optimizer_factor
from pipeline.planner.progress import SILENT, Progress
from pipeline.planner.remembered import Memory, describe, memory_of
from pipeline.planner.result import Plan, PlanError, format_table, no_fit
from pipeline.planner.search import search
from pipeline.planner.space import CHECKPOINTS, Space
from pipeline.planner.tensor import TensorSharding, mesh_shapes, sharding_of
from pipeline.planner.time_model import TimeModel
from pipeline.planner.trials import check_trials, run_trials
from pipeline.splitting.traced import SplitModel

__all__ = ["Plan", "PlanError", "format_bytes", "format_table", "plan", "plan_profile"]


def _space(names: Sequence[str] | None, checkpoints: Sequence[str] | None,
           chunks: Sequence[int] | None, dps: Sequence[int], max_stages_per_rank: int,
           tps: Sequence[int] = (1,), microbatch_rows: Sequence[int] | None = None) -> Space:
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
    if microbatch_rows is not None and (not microbatch_rows or any(
            not isinstance(b, int) or b < 1 for b in microbatch_rows)):
        raise PipeConfigError(f"microbatch_rows must be whole numbers >= 1, the rows of a "
                              f"micro-batch to try (got {microbatch_rows!r})")
    return Space(tuple(variants), modes, tuple(dps), tuple(chunks) if chunks else None,
                 tuple(tps), tuple(microbatch_rows) if microbatch_rows else None)


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


def _whole(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipeConfigError(f"{name} must be an int >= 1 (got {value!r})")
    return value


def _tensor_sizes(tp_sizes: Sequence[int] | None, ranks: int, per_host: int,
                  sharding: TensorSharding | None) -> list[int]:
    """The tp sizes to search: each divides the ranks of a host (tp stays within a host, on
    its fast link) and the ranks; by default every such size when tp is allowed, else 1."""
    if tp_sizes is None:
        if sharding is None:
            return [1]
        return [t for t in range(1, per_host + 1) if per_host % t == 0 and ranks % t == 0]
    sizes = [_whole("each of tp_sizes", t) for t in tp_sizes]
    if not sizes:
        raise PipeConfigError("tp_sizes must name at least one size (1: no tensor parallelism)")
    bad = [t for t in sizes if per_host % t or ranks % t]
    if bad:
        raise PipeConfigError(f"tp_sizes {bad} do not divide both ranks_per_host={per_host} "
                              f"and ranks={ranks}: tensor parallelism stays within a host, so "
                              f"each tp size must divide the ranks of a host and all ranks")
    if sharding is None and any(t > 1 for t in sizes):
        raise PipeConfigError(f"tp_sizes {sizes} allow tensor parallelism, but the planner does "
                              f"not know what it splits: pass tp_plan= (the dict Pipe takes)")
    return sizes


def plan_profile(profile: ModelProfile, *, ranks: int,
                 memory_per_rank: float | Sequence[float] | None, link: Link,
                 schedules: Sequence[str] | None = None, optimizer: str | float = "adam",
                 chunks: Sequence[int] | None = None,
                 microbatch_rows: Sequence[int] | None = None,
                 checkpoints: Sequence[str] | None = None,
                 data_parallel: Sequence[int] | None = None, max_stages_per_rank: int = 4,
                 contention: float = 1.0, sharding: TensorSharding | None = None,
                 tp_sizes: Sequence[int] | None = None, ranks_per_host: int | None = None,
                 host_link: Link | None = None, tp_plan: Mapping[str, Any] | None = None,
                 devices: Sequence[str] | None = None, transport: str | None = None,
                 time_model: TimeModel | None = None, progress: Progress = SILENT,
                 remember: bool | str | os.PathLike[str] | Memory = False) -> Plan:
    """`plan()` on costs already in hand: a `ModelProfile` (measured, or built from a formula,
    e.g. `pipeline.planner.transformer.gpt_profile`) and a `link` between ranks.

    Data parallelism is searched unless `link` is over threads (then dp is 1); tensor
    parallelism when `sharding` says what it splits, at `tp_sizes` (default: every size
    dividing `ranks_per_host` and `ranks`). Ranks sit `ranks_per_host` to a host (default: all
    on one), numbered (dp, pp, tp) with tp innermost: tp groups stay within a host, whose link
    is `host_link` (default `link`, which is then the link between hosts). `tp_plan` is only
    passed on by `Plan.pipe_kwargs`; `transport` (default: the link's) says whether the ranks
    are threads of one process, which run one pipeline. `time_model` (`fit_time_model`) prices
    every candidate as this machine ran measured steps, its contention replacing `contention`.
    `progress` hears of the search's candidates as each is settled. `remember` (True, a
    directory, a `remembered.Memory`; default False here) keeps the last choice for the same
    model and settings unless a candidate is more than `ties.KEEP` faster than it
    (`pipeline.planner.remembered`).
    """
    ranks = _whole("ranks", ranks)
    per_host = ranks if ranks_per_host is None else _whole("ranks_per_host", ranks_per_host)
    if ranks > per_host and ranks % per_host:
        raise PipeConfigError(f"ranks={ranks} do not fill whole hosts of ranks_per_host="
                              f"{per_host}: use a multiple of {per_host} ranks, or the host size "
                              f"your machines have")
    threads = (link.transport if transport is None else transport) == "threads"
    if data_parallel is None:
        dps = [1] if threads else [d for d in range(1, ranks + 1) if ranks % d == 0]
    else:
        dps = list(data_parallel)
        if threads and dps != [1]:
            raise PipeConfigError("data parallelism runs one process per rank: use transport="
                                  "'gloo' or 'nccl' for data_parallel > 1 (threads: [1])")
    tps = _tensor_sizes(tp_sizes, ranks, per_host, sharding)
    if threads and tps != [1]:
        raise PipeConfigError("tensor parallelism runs one process per rank: use transport="
                              "'gloo' or 'nccl' to plan with tp_plan")
    if not contention >= 1.0:
        raise PipeConfigError(f"contention must be a number >= 1 (got {contention!r})")
    limits = _limits(memory_per_rank, ranks)
    factor = optimizer_factor(optimizer)
    space = _space(schedules, checkpoints, chunks, dps, max_stages_per_rank, tps,
                   microbatch_rows)
    memory = memory_of(remember)
    if memory is not None:
        # What determines the candidates (the measured link, contention and time model
        # only price them): the key of the last choice.
        key = memory.key(profile, {
            "ranks": ranks, "ranks_per_host": per_host, "limits": [repr(v) for v in limits],
            "optimizer": list(factor), "space": repr(space),
            "transport": link.transport if transport is None else transport,
            "devices": None if devices is None else [str(d) for d in devices],
            "tp_plan": None if tp_plan is None else sorted(
                (str(k), type(v).__qualname__) for k, v in tp_plan.items())})
        recall = memory.read(key)
    table, least, where = search(profile, link, ranks=ranks, limits=limits, optimizer=factor,
                                 space=space, contention=contention, sharding=sharding,
                                 host_link=host_link, ranks_per_host=per_host,
                                 time_model=time_model, progress=progress,
                                 last=recall.last if memory is not None else None)
    chosen = table[0] if table else None
    if chosen is None or chosen.status != "chosen":
        raise no_fit(limits, least, where, tuple(table))
    said = memory.settle(key, recall, table) if memory is not None else None
    assert chosen.balance is not None and chosen.step_time is not None
    assert chosen.peak_bytes is not None and chosen.activation_bytes is not None
    return Plan(chosen.balance, chosen.schedule, dict(chosen.options), chosen.chunks,
                chosen.checkpoint, chosen.dp, chosen.pp, chosen.rows, chosen.step_time,
                chosen.peak_bytes, chosen.activation_bytes, chosen.allreduce_time, limits,
                tuple(table), tuple(str(d) for d in devices) if devices is not None else None,
                link, profile, time_model.contention if time_model else contention, factor,
                chosen.tp,
                dict(tp_plan) if tp_plan is not None else None, sharding,
                host_link if host_link is not None else link, per_host, remembered=said)


def plan(model: nn.Sequential, sample: Any, target: Any, loss_fn: LossFn, *, ranks: int,
         memory_per_rank: float | Sequence[float] | None, devices: Sequence[str] | None = None,
         schedules: Sequence[str] | None = None, optimizer: str | float = "adam",
         transport: str = "threads", link: Link | None = None,
         profile: ModelProfile | None = None, chunks: Sequence[int] | None = None,
         checkpoints: Sequence[str] | None = None, data_parallel: Sequence[int] | None = None,
         max_stages_per_rank: int = 4, repeats: int = 5,
         contention: float | None = None, tp_plan: Mapping[str, Any] | None = None,
         tp_sizes: Sequence[int] | None = None, ranks_per_host: int | None = None,
         host_link: Link | None = None,
         microbatch_rows: Sequence[int] | None = None, trials: int | None = 0,
         trial_rounds: int = 5, trial_steps: int = 2, trial_warmup: int = 1,
         time_model: TimeModel | None = None, progress: Progress = SILENT,
         remember: bool | str | os.PathLike[str] | None = None) -> Plan:
    """Choose how to pipeline `model` over `ranks` ranks within `memory_per_rank` bytes each.

    `sample` and `target` are one (global) batch, `loss_fn` the loss. A `SplitModel` (see
    `pipeline.split`, e.g. at every block) is planned as its pieces, its sample given as the
    model takes it. Every registered schedule
    (or those named in `schedules`), each checkpoint mode, each dp x pp factorisation of
    `ranks` (`transport` "gloo" or "nccl"; threads run one pipeline) and each micro-batch
    count (`chunks`, or the counts giving micro-batches of `microbatch_rows` rows) is a
    candidate; see `pipeline.planner.search` for how the search is exact or pruned.
    With `tp_plan` (the dict `Pipe(tp_plan=...)` takes), each stage may also be split over tp
    ranks of one host: dp x pp x tp, tp in `tp_sizes` (default: every size dividing
    `ranks_per_host`, which defaults to all ranks on one host), its collectives over
    `host_link` (default: `link`); see `pipeline.planner.tensor` for the model.
    Costs come from profiling the model where it lives (`profile_model`) and from
    measuring the transport (`measure_link`) and, when the ranks are CPUs, how much ranks
    computing at once slow each other (`measure_contention`); pass `profile`, `link` or
    `contention` to reuse measurements; `time_model` (fitted from measured steps on this
    machine, `pipeline.planner.fit_time_model`) adds what the profile and link leave out, and
    its contention is used (none is measured).
    With `trials=k` (default 0: by prediction alone) the k best predicted candidates that fit
    run where the plan is for (threads here; with processes, `plan` is called on every rank of
    the launched group), on copies of the model and this batch: `trial_warmup` untimed and
    `trial_steps` timed steps a turn, every candidate a turn in each of `trial_rounds` rounds
    (shuffled orders); the plan is the measured fastest (`measured_step_time`, `trials`); see
    `pipeline.planner.trials`. The model's weights and gradients are left as they were.
    `progress` (`pipeline.planner.progress.Progress`, e.g. a command line's bar) hears of
    each phase (profiling, measuring the link and contention, searching) and its steps.
    `remember` keeps the last choice for the same model and settings unless a candidate is
    more than `ties.KEEP` faster than it, re-predicted from this run's profile
    (`pipeline.planner.remembered`; `Plan.remembered` says what it did): True, a directory to
    keep it in (default `$PIPELINE_CACHE_DIR/plans`, else the user's cache), or False to
    choose afresh; by default (None) on when `plan` measures the profile itself and chooses
    by prediction (a profile in hand, or `trials=k`, is planned afresh).
    Raises `PlanError` (a `ValueError`) naming the smallest budget that would fit when no
    candidate fits.
    """
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise PipeConfigError(f"plan takes a non-empty nn.Sequential (got "
                              f"{type(model).__name__})")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PipeConfigError(f"ranks must be an int >= 1 (got {ranks!r})")
    k, rounds, steps, warmup = check_trials(trials, trial_rounds, trial_steps, trial_warmup)
    if remember is None:
        remember = profile is None and k == 0
    elif remember is not False and k:
        raise PipeConfigError(f"remember={remember!r} chooses by prediction, keeping the last "
                              f"choice, and trials={k} by measurement: pass remember=False "
                              f"with trials (or trials=0)")
    memory = memory_of(remember, describe(model, sample)) if remember is not False else None
    given = (sample, target, loss_fn)  # a trial's Pipe takes the batch as the model does
    if isinstance(model, SplitModel):  # pieces of a model split at its blocks
        sample, loss_fn = model.flatten(sample), model.with_outputs(loss_fn, "train")
    if transport not in TRANSPORTS:
        raise PipeConfigError(f"transport must be one of {TRANSPORTS} (got {transport!r})")
    if transport == "threads" and data_parallel is not None and list(data_parallel) != [1]:
        raise PipeConfigError("data parallelism runs one process per rank: use transport="
                              "'gloo' or 'nccl' for data_parallel > 1 (threads: [1])")
    if transport == "threads" and tp_plan is not None:
        raise PipeConfigError("tensor parallelism runs one process per rank: use transport="
                              "'gloo' or 'nccl' to plan with tp_plan")
    if devices is not None and transport == "threads" and len(devices) != ranks:
        raise PipeConfigError(f"give one device per rank: {ranks} ranks, {len(devices)} "
                              f"devices {list(devices)}")
    if k:
        from pipeline.planner.trial_runs import check_launch

        check_launch(transport, ranks)  # before anything is measured
    sharding = sharding_of(model, tp_plan) if tp_plan is not None else None
    per_host = ranks if ranks_per_host is None else _whole("ranks_per_host", ranks_per_host)
    tps = _tensor_sizes(tp_sizes, ranks, per_host, sharding)
    dps = ([1] if transport == "threads" else [d for d in range(1, ranks + 1) if ranks % d == 0]) \
        if data_parallel is None else list(data_parallel)
    space = _space(schedules, checkpoints, chunks, dps, max_stages_per_rank, tps,
                   microbatch_rows)  # checks the arguments before anything is measured
    _limits(memory_per_rank, ranks)
    if profile is None:
        batch = _batch_rows(sample)
        sizes = {-(-(batch // d) // m) for d, p, _ in mesh_shapes(ranks, batch, dps, tps)
                 for m in space.chunk_counts(batch // d, p)}
        profile = profile_model(model, sample, target, loss_fn, rows=sorted(sizes),
                                repeats=repeats, progress=progress)
    if link is None or (contention is None and time_model is None):
        progress.phase("measuring the link and contention", 2)
    if link is None:
        pair = list(devices[:2]) if devices is not None and len(devices) > 1 else ["cpu", "cpu"]
        link = measure_link(transport, devices=pair)
        progress.advance()
    if contention is None and time_model is None:
        on_cpu = devices is None or all(str(d).startswith("cpu") for d in devices)
        contention = (measure_contention(model, sample, ranks=ranks)
                      if on_cpu and ranks > 1 and sample is not None else 1.0)
        progress.advance()
    p = plan_profile(profile, ranks=ranks, memory_per_rank=memory_per_rank, link=link,
                     schedules=schedules, optimizer=optimizer, chunks=chunks,
                     microbatch_rows=microbatch_rows, checkpoints=checkpoints,
                     data_parallel=dps, max_stages_per_rank=max_stages_per_rank,
                     contention=1.0 if contention is None else contention,
                     sharding=sharding, tp_sizes=tps,
                     ranks_per_host=ranks_per_host, host_link=host_link, tp_plan=tp_plan,
                     devices=devices, transport=transport, time_model=time_model,
                     progress=progress, remember=memory if memory is not None else False)
    if k == 0:
        return p
    return run_trials(p, model, *given, k=k, rounds=rounds, steps=steps, warmup=warmup,
                      transport=transport)


def _batch_rows(sample: Any) -> int:
    from pipeline.runtime.microbatch import leading_rows

    rows = leading_rows(sample)
    if rows is None:
        raise PipeConfigError("sample holds no tensor with a batch dimension (dim 0): pass "
                              "one batch of the model's input")
    return rows
