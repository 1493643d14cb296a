"""Pipe's configuration, resolved and checked: arguments, balance, ranks, devices, mesh."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import schedules
from pipeline.comm import bootstrap
from pipeline.errors import PipeConfigError
from pipeline.parallel.data_parallel import SHARDING
from pipeline.parallel.mesh import Mesh, resolve_mesh
from pipeline.parallel.tensor_parallel import matches
from pipeline.runtime.recompute import CHECKPOINT_MODES
from pipeline.splitting import checks
from pipeline.splitting.outline import held_whole, whole_modules
from pipeline.splitting.partition import BalanceError, bounds, partition, split_sizes
from pipeline.splitting.profile import layer_params, layer_sizes, layer_times
from pipeline.splitting.split import split as split_graph
from pipeline.splitting.traced import SplitModel
from schedules import Schedule

__all__ = ["Layout", "balance_layers", "check_arguments", "check_sharding", "check_split",
           "make_schedule", "resolve", "split_model"]

_METHODS = ("uniform", "params", "time", "size")


def check_arguments(model: object, chunks: object, checkpoint: object, param_init: object,
                    timeout: object, devices: Sequence[object] | None) -> float:
    """The arguments that need no resolving, each checked; returns `timeout` in seconds."""
    if not isinstance(model, nn.Sequential):
        raise PipeConfigError(
            f"Pipe takes an nn.Sequential (got {type(model).__name__}); flatten your model "
            f"into nn.Sequential(layer, layer, ...) with each layer taking the previous "
            f"one's output"
        )
    if len(model) == 0:
        raise PipeConfigError("the nn.Sequential is empty: give it at least one layer")
    if checkpoint not in CHECKPOINT_MODES:
        raise PipeConfigError(f"checkpoint must be one of {CHECKPOINT_MODES} "
                              f"(got {checkpoint!r})")
    if not callable(param_init) and param_init not in bootstrap.PARAM_INITS:
        raise PipeConfigError(f"param_init must be one of {bootstrap.PARAM_INITS} or a "
                              f"function of a module (got {param_init!r})")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise PipeConfigError(f"chunks must be an int >= 1 (got {chunks!r})")
    checks.check_devices(devices)
    return checks.check_timeout(timeout)


@dataclass(frozen=True)
class Layout:
    """Where everything goes: layers per stage, ranks, this process's rank and group, devices."""

    balance: list[int]
    num_ranks: int
    devices: list[torch.device]
    world: tuple[int, int] | None  # (rank, size) in the pipeline's group; None: threads
    group: Any  # the pipeline's process group (None: the default group)
    mesh: Mesh | None  # pipeline x data parallelism

    @property
    def bounds(self) -> list[int]:
        """Index of each stage's first layer, and the number of layers at the end."""
        return bounds(self.balance)


def resolve(model: nn.Sequential, balance: Sequence[int] | str | None, stages: int | None,
            devices: Sequence[str | torch.device] | None, schedule: str | Schedule,
            sample: Any, group: Any, mesh: Any) -> Layout:
    """Resolve the Pipe's layout from its arguments (and the process group, or mesh)."""
    placement = resolve_mesh(mesh, group)
    if placement is not None:
        group = placement.pp
    # Several processes (torchrun, or our launcher): this process is one rank.
    world = bootstrap.world(group)
    count = len(devices) if devices is not None else (world[1] if world else None)
    per_rank = _stages_per_rank(schedule, stages, balance, count)
    resolved = _resolve_balance(model, balance, stages, count, per_rank, sample, group, world)
    num_stages = len(resolved)
    what = "processes" if devices is None else "devices"
    if isinstance(schedule, str) and count is not None:
        _check_stage_count(schedule, num_stages, count, what)
    if num_stages % per_rank:
        raise PipeConfigError(
            f"{num_stages} stages cannot be spread {per_rank} per rank: give a multiple of "
            f"{per_rank} stages (a balance of {num_stages + per_rank - num_stages % per_rank} "
            f"entries, say), {per_rank} per rank")
    num_ranks = num_stages // per_rank
    if count is not None and count != num_ranks:
        raise PipeConfigError(
            f"{num_stages} stages at {per_rank} per rank need {num_ranks} ranks, got "
            f"{count} {what}{f' ({list(devices)})' if devices is not None else ''}: pass one "
            f"device per rank (one process per rank), or {per_rank} x {what} stages"
        )
    if isinstance(schedule, Schedule):
        schedules.validate(schedule)
        if schedule.num_stages != num_stages:
            raise PipeConfigError(f"the schedule has {schedule.num_stages} stages but the "
                                  f"balance {resolved} has {num_stages}")
    rank_devices = (bootstrap.rank_devices(devices, num_ranks, world[0]) if world
                    else _resolve_devices(devices, num_ranks))
    return Layout(resolved, num_ranks, rank_devices, world, group, placement)


def _resolve_devices(devices: Sequence[str | torch.device] | None,
                     count: int) -> list[torch.device]:
    resolved = [torch.device(d) for d in (devices or ["cpu"] * count)]
    for d in resolved:
        if d.type == "cuda" and not torch.cuda.is_available():
            raise PipeConfigError(f"device {d} was asked for but CUDA is not available; "
                                  f"use devices=['cpu', ...]")
    return [bootstrap.indexed(d) for d in resolved]


def _check_stage_count(name: str, num_stages: int, count: int, what: str) -> None:
    """Refuse a stage count the named schedule cannot place on `count` ranks, saying how many
    stages to give (its generator's own error names the rule, not the balance's length)."""
    gen = schedules.info(name)
    if gen.stages_option is None:
        k = gen.stages_per_rank
        if k > 1 and num_stages != k * count:
            raise PipeConfigError(
                f"schedule {name!r} places {k} stages on each rank, so {count} {what} take "
                f"{k * count} stages (got {num_stages}): give {k} x {what} stages: a balance "
                f"of {k * count} entries (or stages={k * count}) for {count} {what}")
        return
    least = gen.stages_per_rank  # the option's default: the least the generator takes
    why = (f"{num_stages} stages do not spread evenly over {count} {what}"
           if num_stages % count else None)
    if why is None:
        try:
            schedules.get_schedule(name, count, 1, **gen.options_for(
                stages_per_rank=num_stages // count))
        except schedules.ScheduleError as exc:
            why = getattr(exc, "reason", None) or str(exc).splitlines()[0]
    if why is not None:
        raise PipeConfigError(
            f"schedule {name!r} cannot place {num_stages} stages on {count} {what}: {why}. "
            f"Give {gen.stages_option} x ranks balance entries (or stages=), e.g. "
            f"{least * count} for {count} {what}")


def _stages_per_rank(schedule: str | Schedule, stages: int | None,
                     balance: Sequence[int] | str | None, num_ranks: int | None) -> int:
    if isinstance(schedule, Schedule):
        return schedule.stages_per_rank
    if not isinstance(schedule, str) or schedule not in schedules.available():
        raise PipeConfigError(f"unknown schedule {schedule!r}; known: "
                              f"{', '.join(schedules.available())}, or a Schedule object")
    gen = schedules.info(schedule)
    if gen.stages_option is None:
        return gen.stages_per_rank
    count = len(balance) if isinstance(balance, list | tuple) else stages
    if count is not None and num_ranks is not None:
        return max(1, count // num_ranks)
    return gen.stages_per_rank

def _resolve_balance(model: nn.Sequential, balance: Sequence[int] | str | None,
                     stages: int | None, num_ranks: int | None, per_rank: int,
                  sample: Any, group: Any, world: tuple[int, int] | None) -> list[int]:
    n = len(model)
    if isinstance(balance, list | tuple):
        if stages is not None and stages != len(balance):
            raise PipeConfigError(f"stages={stages} disagrees with balance of "
                                  f"{len(balance)} stages {list(balance)}")
        checks.check_balance_list(balance)
        if any(b < 1 for b in balance):
            raise BalanceError(f"every stage needs at least one layer (balance: "
                               f"{list(balance)})")
        if sum(balance) != n:
            raise BalanceError(_misfit(model, list(balance)))
        return list(balance)
    method = balance or "uniform"
    if method not in _METHODS:
        raise PipeConfigError(f"balance must be a list of layer counts or one of {_METHODS} "
                              f"(got {balance!r})")
    k = stages or (num_ranks or 2) * per_rank
    if k > n:
        raise BalanceError(f"cannot split {n} layers into {k} stages: every stage needs a "
                           f"layer; use stages <= {n}")
    if method == "uniform":
        return split_sizes(n, k)
    if method == "params":
        return partition(layer_params(model), k)

    def profiled() -> list[int]:
        if sample is None:
            raise PipeConfigError(f"balance={method!r} profiles the model: pass "
                                  f"sample=<a batch> too")
        costs = layer_times(model, sample) if method == "time" else layer_sizes(model, sample)
        return partition(costs, k)
    # Several processes: rank 0 profiles and every rank takes its balance (profiles differ).
    return bootstrap.from_first_rank(group, profiled) if world else profiled()


def split_model(model: nn.Module, example_inputs: Any, split_points: Sequence[str] | None,
                balance: Sequence[int] | str | None, stages: int | None,
                devices: Sequence[str | torch.device] | None, schedule: str | Schedule,
                group: Any, mesh: Any, tp_plan: Any = None
                ) -> tuple[nn.Sequential, Sequence[int] | str | None, int | None]:
    """With `example_inputs`, the model split from its exported graph (one layer per stage)
    and the balance and stage count that say so; else the arguments as they are. The
    modules a `tp_plan` shards are kept whole (pipeline/splitting/outline.py)."""
    if example_inputs is None:
        if split_points is not None:
            raise PipeConfigError("split_points= name modules of a model split from its "
                                  "graph: pass example_inputs= too (what the model is called "
                                  "with)")
        if not isinstance(model, nn.Sequential):
            raise PipeConfigError(
                f"Pipe takes an nn.Sequential, or any model with example_inputs= (what it is "
                f"called with) to split it from its graph (got {type(model).__name__} without "
                f"example_inputs); e.g. Pipe(model, example_inputs={{'input_ids': ids}}, "
                f"split_points=['model.layers.2'])")
        return model, balance, stages
    if split_points is not None and stages is not None and stages != len(split_points) + 1:
        raise PipeConfigError(f"stages={stages} disagrees with {len(split_points)} split "
                              f"points (stages = split points + 1); give one of them")
    if isinstance(balance, list | tuple):
        raise PipeConfigError(
            f"balance={list(balance)} counts layers of an nn.Sequential; a model split from "
            f"its graph takes split_points=[module names], or stages=N with balance one of "
            f"{_METHODS}")
    placement = resolve_mesh(mesh, group)
    world = bootstrap.world(placement.pp if placement is not None else group)
    if split_points is None and stages is None:
        count = len(devices) if devices is not None else (world[1] if world else 2)
        stages = count * _stages_per_rank(schedule, None, None, count)
    method = balance or "params"
    if method not in _METHODS:
        raise PipeConfigError(f"balance must be one of {_METHODS} (got {balance!r})")
    pp = placement.pp if placement is not None else group
    whole = (whole_modules(model, [n for key in tp_plan for n in matches(model, key)])
             if isinstance(tp_plan, dict) else [])
    split = split_graph(model, example_inputs, split_points=split_points,
                        stages=None if split_points is not None else stages, balance=method,
                        agree=(lambda f: bootstrap.from_first_rank(pp, f)) if world else None,
                        keep_whole=whole)
    return split, [1] * len(split), None


def check_split(model: nn.Sequential, deferred_batch_norm: object) -> None:
    """What a model split from its graph cannot do."""
    if deferred_batch_norm and isinstance(model, SplitModel):
        raise PipeConfigError(
            "deferred_batch_norm works on BatchNorm modules the stages call; a model split "
            "from its graph runs batch_norm as an op, so its statistics would be left per "
            "micro-batch: train with deferred_batch_norm=False (running statistics updated "
            "per micro-batch, as GPipe does), or pass an nn.Sequential")


def check_tensor_parallel(tp_plan: dict[str, Any] | None, model: nn.Module,
                          ties: Sequence[Any]) -> None:
    """What tensor parallelism inside stages cannot do (yet), with the reason."""
    if tp_plan is None:
        return
    if ties:
        names = ", ".join(repr(t.key) for t in ties)
        raise PipeConfigError(
            f"tp_plan with weights tied across stages ({names}) is not supported: a tied "
            f"weight is refreshed and its gradient added as a whole tensor, not as tp "
            f"shards. Untie them (e.g. give the head its own weight), or keep both users of "
            f"the tied weight in one stage")
    if isinstance(model, SplitModel):
        # Traced ops call no module a ParallelStyle hooks into: what the plan shards must
        # run as modules, kept whole when the model was split.
        traced = [n for key in tp_plan for stage in model for n in matches(stage, key)
                  if not held_whole(n, model.whole)]
        if traced:
            raise PipeConfigError(
                f"tp_plan shards {traced[:3]}, which this split model runs as traced ops "
                f"(a ParallelStyle hooks module calls): split it inside Pipe, "
                f"Pipe(model, example_inputs=..., split_points=..., tp_plan=...), which keeps "
                f"them whole, or pipeline.split(..., keep_whole=[their parent modules])")


def balance_layers(model: nn.Sequential, method: str, stages: int, sample: Any) -> list[int]:
    """Layers per stage for `stages` stages of `model` by `method` (one of "uniform",
    "params", "time", "size"), in this process."""
    return _resolve_balance(model, method, stages, None, 1, sample, None, None)


def make_schedule(arg: str | Schedule, balance: list[int], num_ranks: int, chunks: int,
              num_batches: int) -> Schedule:
    """The lowered, validated schedule of `chunks` micro-batches x `num_batches` batches."""
    if isinstance(arg, Schedule):
        if arg.num_stages != len(balance):
            raise PipeConfigError(f"the schedule has {arg.num_stages} stages but the "
                                  f"balance {balance} has {len(balance)}")
        if (arg.num_microbatches, arg.num_batches) != (chunks, num_batches):
            raise PipeConfigError(
                f"the schedule is for {arg.num_microbatches} micro-batches x "
                f"{arg.num_batches} batches; this call needs chunks={chunks} x {num_batches}")
        return schedules.validate(schedules.lower(arg))
    gen = schedules.info(arg)
    options = gen.options_for(stages_per_rank=len(balance) // num_ranks,
                              num_batches=num_batches)
    built = schedules.get_schedule(arg, num_ranks, chunks, **options)
    return schedules.validate(schedules.lower(built))


def check_sharding(data_parallel: object, layout: Layout, schedule: str | Schedule) -> None:
    """`data_parallel="fsdp"` needs a mesh with "dp" and a schedule FSDP2 can follow: whole
    backwards (no I/W split: FSDP2 reduces in the backward's hooks) and one set of weights."""
    if data_parallel not in SHARDING:
        raise PipeConfigError(f"data_parallel must be one of {SHARDING} (got {data_parallel!r})")
    if data_parallel == "replicate":
        return
    if layout.mesh is None or layout.mesh.dp is None:
        raise PipeConfigError("data_parallel='fsdp' shards over a mesh's 'dp' dimension: pass "
                              "mesh=init_device_mesh(..., mesh_dim_names=('dp', 'pp'))")
    name = schedule.name if isinstance(schedule, Schedule) else schedule
    probe = schedule if isinstance(schedule, Schedule) else make_schedule(
        schedule, layout.balance, layout.num_ranks, 1, 1)
    ops = {a.op for row in probe.actions for a in row}
    if ops & {schedules.Op.I, schedules.Op.W, schedules.Op.U}:
        raise PipeConfigError(
            f"data_parallel='fsdp' cannot run schedule {name!r}: FSDP2 reduces gradients in "
            f"hooks of a whole backward, and this schedule splits backwards (zero-bubble) or "
            f"versions weights (2BW). Use 'gpipe', '1f1b' or 'interleaved' with FSDP2, or "
            f"data_parallel='replicate' (every schedule)")


def _misfit(model: nn.Sequential, balance: list[int]) -> str:
    """Why `balance` does not cover `model`: the layers left over or the excess, and a fit."""
    n, total = len(model), sum(balance)
    head = (f"model and sum of balance have different length (model: {n} layers, sum of "
            f"balance {balance}: {total})")
    if total < n:
        kinds = [type(layer).__name__ for layer in model]
        shown = ", ".join(kinds[total:total + 4]) + (", ..." if n - total > 4 else "")
        what = (f"layer{'s' if n - total > 1 else ''} {total}"
                f"{f' to {n - 1}' if n - total > 1 else ''} ({shown}) "
                f"{'are' if n - total > 1 else 'is'} in no stage")
    else:
        what = f"the balance asks for {total - n} layers more than the model's {n}"
    k = min(len(balance), n)
    fits = split_sizes(n, k)
    return (f"{head}: {what}; the counts must add up to {n}, e.g. balance={fits} "
            f"(or stages={k}, balance='params' to have them chosen)")
