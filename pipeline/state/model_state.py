"""A Pipe's state by the model's keys: gathered to one rank, loaded per rank, and resumed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.comm import collectives
from pipeline.comm.process_group import PeerFailure, ProcessTransport
from pipeline.comm.transport import PipelineAborted
from pipeline.errors import PipeConfigError, PipelineError
from pipeline.parallel.tensor_parallel import full_tensor, shard_like
from pipeline.splitting import checks, partition
from pipeline.splitting.traced import layer_key

__all__ = ["full_state_dict", "load_training_state", "loadable", "tied_keys", "training_state"]

_TRAINING_KEYS = {"model", "weight_versions", "rng_cpu", "rng_cuda"}


def full_state_dict(pipe: Any, dst: int) -> dict[str, torch.Tensor] | None:
    """The whole model's state_dict on rank `dst` of the pipeline (of dp rank 0), None on the
    others; every rank calls it. In one process, `state_dict()`."""
    if not pipe.world:
        return dict(pipe.state_dict())
    if pipe._replicas is not None and pipe._replicas.mesh.dp_rank != 0:
        return None  # every replica holds the same weights: the first one gathers them
    state = dict(pipe.state_dict())
    if pipe._tp_plan is not None:  # every tp rank gathers its shards; tp rank 0's pipeline
        state = {k: full_tensor(v) for k, v in state.items()}  # sends them on
        if pipe.mesh.tp_rank != 0:
            return None
    owner = {}
    model: nn.Sequential = pipe.__dict__["_full_model"]
    stage_of = partition.stage_of(pipe.balance)
    for i, name in enumerate(model._modules):
        rank = pipe._probe.rank_of(stage_of[i])
        for key in model._modules[name].state_dict():
            owner[layer_key(model, name, key)] = rank
    for tie in pipe._ties:  # a tied weight's copies are reported by its owner's rank
        owner.update({k: pipe._probe.rank_of(tie.stage) for c in tie.copies for k in c.keys})
    try:
        transport = pipe._executor.transport
        assert isinstance(transport, ProcessTransport)
        return collectives.gather_state_dict(model, state, owner, transport, dst)
    except (PipelineAborted, PeerFailure) as exc:
        raise PipelineError(str(exc)) from None


def loadable(pipe: Any, state_dict: Any, strict: bool,
             named_parameters: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """The entries of `state_dict` this rank loads, checked (multi-process: its own layers'),
    with the copies of tied weights as this rank's modules hold them (see parallel/ties.py).
    `named_parameters`: the module's own, copies included."""
    if pipe.world:
        mine = set(pipe.state_dict())
        state_dict = {k: v for k, v in state_dict.items() if k in mine}
    own = pipe.state_dict()
    checks.check_state_dict(own, state_dict, strict)
    # Under tp, a whole tensor loads as this rank's shard of it.
    state_dict = {k: shard_like(own[k], v) if k in own else v for k, v in state_dict.items()}
    add, drop = pipe._tie_link.state_dict_keys()
    # A key the owner's stage holds itself stays (a model split from its graph: GPT-2's
    # embedding reads the tied weight as `lm_head.weight`, the head's copy's key too).
    held = {k for k, _ in named_parameters}
    state_dict = {k: v for k, v in state_dict.items() if k not in add or k in held}
    for k, p in named_parameters:
        if k in drop:  # the copy's current value; its owner's comes with the next run
            state_dict.setdefault(k, p.detach())
    return dict(state_dict)


def tied_keys(pipe: Any, state: dict[str, Any], prefix: str, _: Any) -> None:
    """State-dict hook: a tied weight's keys carry its owner's value on the owner's rank, and
    are left out where only a copy lives (its owner's rank reports them)."""
    add, drop = pipe._tie_link.state_dict_keys()
    for key in drop:
        state.pop(prefix + key, None)
    for key, owner in add.items():
        state.setdefault(prefix + key, owner.detach())


def training_state(pipe: Any) -> dict[str, Any]:
    """Parameters and buffers (the model's keys), 2BW's previous weights, torch's generators."""
    return {
        "model": dict(pipe.state_dict()),
        "weight_versions": {s: dict(w) for s, w in pipe._versions.previous.items()},
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def load_training_state(pipe: Any, state: dict[str, Any]) -> None:
    """Restore what `training_state` saved (a state missing a part is refused, named)."""
    missing = _TRAINING_KEYS - set(state)
    if missing:
        raise PipeConfigError(f"not a Pipe training state: it lacks {sorted(missing)} "
                              f"(save one with pipe.training_state())")
    pipe.load_state_dict(state["model"])
    pipe._versions.load_previous(state["weight_versions"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"]:
        torch.cuda.set_rng_state_all(state["rng_cuda"])
