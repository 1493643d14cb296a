"""Building a Pipe: its constructor's named steps, from the model to running rank threads."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from torch import nn

from pipeline.comm import bootstrap
from pipeline.errors import PipeConfigError
from pipeline.parallel import agreement, tensor_parallel, ties
from pipeline.parallel.data_parallel import Replicas
from pipeline.runtime.batchnorm import DeferredBatchNorm, check_mode
from pipeline.runtime.executor import Executor
from pipeline.runtime.programs import Programs
from pipeline.runtime.versions import WeightVersions
from pipeline.splitting import config, lengths, partition
from pipeline.splitting.traced import SplitModel, merge_into
from pipeline.state import model_state
from schedules import Schedule

if TYPE_CHECKING:
    import torch

    from pipeline.parallel.mesh import Mesh
    from pipeline.pipe import Pipe

__all__ = ["Assembled", "lay_out", "link_ties", "place_layers", "start_runtime"]


class Assembled:
    """The parts of a Pipe that the steps below set, declared once (Pipe derives from it)."""

    balance: list[int]  # layers per stage
    num_ranks: int
    devices: list[torch.device]  # one per rank
    world: tuple[int, int] | None  # (rank, size) in the pipeline's group; None: threads
    group: Any  # the pipeline's process group
    mesh: Mesh | None
    partitions: list[nn.Sequential]  # one per stage, this rank's holding its layers
    local_stages: tuple[int, ...]  # the stages this rank runs
    _tp_plan: dict[str, Any] | None
    _ties: list[ties.Tie]
    _programs: Programs
    _probe: Schedule  # the schedule at one micro-batch: where each stage runs
    _agreement: agreement.Agreement
    _versions: WeightVersions
    _executor: Executor
    _replicas: Replicas | None
    _batch_norm: DeferredBatchNorm | None
    _tie_link: ties.TieLink


def lay_out(pipe: Pipe, model: nn.Sequential, balance: Any, stages: int | None, devices: Any,
            schedule: str | Schedule, sample: Any, group: Any, mesh: Any, data_parallel: str,
            deferred_batch_norm: bool | str, tp_plan: dict[str, Any] | None) -> None:
    """Where every layer goes: the balance, ranks, devices, the process group and mesh, the
    ties between stages, the programs, and this rank's stages."""
    layout = config.resolve(model, balance, stages, devices, schedule, sample, group, mesh)
    pipe.balance, pipe.num_ranks = layout.balance, layout.num_ranks
    pipe.devices, pipe.world, pipe.group = layout.devices, layout.world, layout.group
    pipe.mesh = layout.mesh
    config.check_sharding(data_parallel, layout, schedule)
    config.check_split(model, deferred_batch_norm)
    pipe._tp_plan = tensor_parallel.check_plan(tp_plan, pipe.mesh)
    layers = list(model)
    pipe.partitions = [nn.Sequential(*layers[a:b]) for a, b in itertools.pairwise(layout.bounds)]
    pipe._ties = ties.find_ties(model, pipe.balance)
    if pipe._ties and data_parallel == "fsdp":
        raise PipeConfigError("data_parallel='fsdp' does not shard weights tied across "
                              "stages: use data_parallel='replicate' for this model")
    config.check_tensor_parallel(pipe._tp_plan, model, pipe._ties)
    pipe._programs = Programs(schedule, pipe.balance, pipe.num_ranks,
                              [(t.stage, [c.stage for c in t.copies]) for t in pipe._ties],
                              dp=False, processes=bool(pipe.world))
    # The placement comes from the schedule.
    pipe._probe = (pipe._programs.schedule(1, 1) if not isinstance(schedule, Schedule)
                   else schedule)
    pipe.local_stages = (pipe._probe.stages_of(pipe.world[0]) if pipe.world
                         else tuple(range(len(pipe.balance))))


def place_layers(pipe: Pipe, model: nn.Sequential, param_init: Any, chunks: int,
                 checkpoint: str, data_parallel: str) -> None:
    """This rank's layers on their devices, registered under the model's names (the same
    Parameters, the same keys), sharded by the tensor-parallel plan if there is one."""
    ties.untie(pipe._ties, pipe.local_stages)
    copies = frozenset((id(m), a) for t in pipe._ties for c in t.copies
                       if c.param is not None for m, a in c.places)
    bounds, layers = partition.bounds(pipe.balance), list(model)
    names = list(model._modules)  # named_children() would skip a layer used twice
    # A model split from its graph: its inputs flattened, its outputs rebuilt (not a child).
    pipe.__dict__["_io"] = model if isinstance(model, SplitModel) else None
    for s in pipe.local_stages:
        device = pipe.devices[pipe._probe.rank_of(s)]
        for i in range(bounds[s], bounds[s + 1]):
            layer = bootstrap.materialize(layers[i], device,  # split: the model's keys
                                          name=names[i] if pipe._io is None else "",
                                          param_init=param_init, exempt=copies)
            if pipe._io is not None:  # the model's tree, by the model's keys
                merge_into(pipe, layer)
            else:
                pipe.add_module(names[i], layer)
    if pipe._tp_plan is not None and pipe.mesh is not None:  # before anything holds params
        tensor_parallel.shard_stages(
            pipe, pipe._tp_plan, pipe.mesh, model,
            [pipe.partitions[s] for s in pipe.local_stages], balance=pipe.balance,
            schedule=pipe._probe.name, chunks=chunks, checkpoint=checkpoint,
            data_parallel=data_parallel)
    pipe.__dict__["_full_model"] = model  # structure only (may live on "meta")


def start_runtime(pipe: Pipe, chunks: int, data_parallel: str, broadcast_buffers: bool,
                  deferred_batch_norm: bool | str) -> None:
    """The executor (rank threads or this process's rank and its links), data parallelism's
    replicas, weight versions (2BW) and deferred BatchNorm."""
    local: dict[int, nn.Module] = {s: pipe.partitions[s] for s in pipe.local_stages}
    pipe._agreement = agreement.Agreement()  # ranks compare configurations (processes)
    pipe._versions = WeightVersions(local)
    pipe._executor = Executor(list(pipe.partitions), pipe.devices, pipe._probe, pipe.world,
                              pipe.group, pipe.timeout, pipe.mesh)
    lengths.connect(pipe._io, pipe._executor.transport)  # ranks agree on each batch's shapes
    pipe._replicas = (Replicas(pipe.mesh, local, pipe.devices[pipe.world[0]], pipe.timeout,
                               data_parallel, broadcast_buffers=broadcast_buffers)
                      if pipe.mesh is not None and pipe.mesh.dp_size > 1 and pipe.world
                      else None)
    pipe._programs.dp = pipe._replicas is not None  # dp's syncs join the programs
    over_dp = pipe._replicas is not None and deferred_batch_norm == "global"
    pipe._batch_norm = (DeferredBatchNorm(
        list(local.values()), chunks,
        reduce=pipe._replicas.all_reduce if over_dp and pipe._replicas else None)
        if check_mode(deferred_batch_norm) else None)


def link_ties(pipe: Pipe) -> None:
    """Weights tied across stages: the copies follow their owner (hooks), and state_dict
    keeps the model's tied keys."""
    pipe._tie_link = ties.link(pipe._ties, dict(nn.Module.named_parameters(
        pipe, remove_duplicate=False)))
    ties.register_hooks(pipe._tie_link)
    pipe._register_state_dict_hook(model_state.tied_keys)  # type: ignore[no-untyped-call]
