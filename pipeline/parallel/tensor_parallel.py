"""Tensor parallelism inside stages: torch's `parallelize_module` over the mesh's "tp" group.

Each rank holds its stages' layers; a plan in torch's form (module-name pattern to
`ParallelStyle`, the names the user's model has) is applied to the layers this rank holds,
after they are materialised and before anything captures their parameters. Stages then
exchange activations rank to rank within the same "tp" coordinate, as torchtitan does: what a
stage's last module leaves (replicated, or a sequence shard) is what travels.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn

from pipeline.comm.handed import handed
from pipeline.errors import PipeConfigError, PipeTypeError
from pipeline.parallel.mesh import Mesh

__all__ = ["agree", "agree_on_seed", "apply_plan", "check_plan", "describe", "full_tensor",
           "grads_as_params", "like_param", "local_tensor", "matches", "settle", "shard_like",
           "shard_stages"]


def check_plan(tp_plan: Any, mesh: Mesh | None) -> dict[str, Any] | None:
    """The plan, checked against the mesh: a "tp" dimension needs a plan and a plan needs one."""
    tp = mesh.tp_size if mesh is not None and mesh.tp is not None else None
    if tp_plan is None:
        if tp is not None and tp > 1:
            raise PipeConfigError(
                f"the mesh has a 'tp' dimension of size {tp} but no tp_plan was given: pass "
                f"tp_plan={{'<module name>': ColwiseParallel(), ...}} (torch.distributed."
                f"tensor.parallel styles) saying how each stage's modules are sharded")
        return None
    if tp is None:
        raise PipeConfigError(
            "tp_plan= shards stages over a mesh's 'tp' dimension, and no mesh with one was "
            "given: pass mesh=init_device_mesh(device, (dp, pp, tp), "
            "mesh_dim_names=('dp', 'pp', 'tp'))")
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(tp_plan, Mapping):
        raise PipeTypeError(f"tp_plan must be a dict from module-name pattern to a "
                            f"ParallelStyle (got {type(tp_plan).__name__})")
    for key, style in tp_plan.items():
        if not isinstance(key, str) or not key:
            raise PipeTypeError(f"tp_plan's keys are module names or fnmatch patterns of "
                                f"them, as model.named_modules() gives (got {key!r})")
        if not isinstance(style, ParallelStyle):
            raise PipeTypeError(f"tp_plan[{key!r}] must be a torch.distributed.tensor."
                                f"parallel ParallelStyle (got {type(style).__name__})")
    return dict(tp_plan)


def matches(module: nn.Module, pattern: str) -> list[str]:
    """The names of `module`'s submodules `pattern` selects, as `parallelize_module` reads a
    plan's key: dotted, each part an fnmatch pattern of a child's name."""
    found = [("", module)]
    for token in pattern.split("."):
        found = [(f"{name}.{child_name}" if name else child_name, child)
                 for name, m in found for child_name, child in m.named_children()
                 if fnmatch(child_name, token)]
    return [name for name, _ in found]


def apply_plan(root: nn.Module, plan: dict[str, Any], mesh: Mesh, model: nn.Module) -> bool:
    """Shard the layers `root` holds (registered under the model's names) by `plan` over
    the mesh's "tp" group; True if any was. Every key must name a module of `model` (the
    whole model: a key may select layers another rank holds)."""
    # A model split from its graph holds the model's modules in its stages, by their names.
    roots: list[nn.Module] = list(model.children()) if _split_from_graph(model) else [model]
    for key in plan:
        if not any(matches(r, key) for r in roots):
            names = sorted({n for r in roots for n, _ in r.named_modules() if n})
            near = difflib.get_close_matches(key, names, n=3)
            raise PipeConfigError(
                f"tp_plan key {key!r} selects no module of the model"
                + (f"; did you mean {', '.join(map(repr, near))}?" if near else
                   f" (its modules are named like {names[:4]})"))
    # Each key as the names it selects here (in the plan's order: styles on one module apply
    # in turn): a pattern selecting nothing in some layers is no mistake, torch warns of it.
    mine = {name: style for key, style in plan.items() for name in matches(root, key)}
    if not mine:
        return False
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(root, mesh.tp_mesh, mine)
    return True


def shard_stages(root: nn.Module, plan: dict[str, Any], mesh: Mesh, model: nn.Module,
                 stages: Iterable[nn.Module], **settings: Any) -> None:
    """Shard this rank's layers (held by `root` under the model's names) by `plan`, once the
    stage's tp ranks agree on `settings` (sharding runs collectives over "tp" that must
    match); each stage's outputs are settled before they are sent (see `settle`)."""
    agree(describe(plan, **settings), mesh)
    apply_plan(root, plan, mesh, model)
    for stage in stages:
        stage.register_forward_hook(_settled)


def _settled(module: nn.Module, inputs: Any, outputs: Any) -> Any:
    return settle(outputs)


def _split_from_graph(model: nn.Module) -> bool:
    from pipeline.splitting.traced import SplitModel  # the splitting package imports this one

    return isinstance(model, SplitModel)


class _Settled(torch.autograd.Function):
    """An `AsyncCollectiveTensor` waited for and unwrapped into a plain tensor, its gradient
    passed through: what a stage sends is the tensor's memory, so the collective that makes
    it must be done first."""

    @staticmethod
    def forward(ctx: Any, value: Any) -> Any:
        return value.wait()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad


def settle(values: Any) -> Any:
    """A stage's outputs as plain tensors of this rank's values: every pending collective
    result (RowwiseParallel's output, by default) waited for, every DTensor its local shard;
    a tuple or a single value, as the stage returned it."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    def one(v: Any) -> Any:
        if isinstance(v, DTensor):  # a style that keeps DTensors: its local shard travels
            v = v.to_local()
        if isinstance(v, AsyncCollectiveTensor):
            return _Settled.apply(v)  # type: ignore[no-untyped-call]
        return v

    if isinstance(values, tuple):
        return tuple(one(v) for v in values)
    return one(values)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a parameter or gradient under tp); `t` otherwise."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before its import
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t._local_tensor  # type: ignore[no-any-return]
    return t


def describe(plan: dict[str, Any], **settings: Any) -> str:
    """What the tp ranks of a stage must share: the plan (each key's style, with its
    settings) and the pipeline's settings."""
    styles = {key: [type(style).__name__, sorted((k, repr(v)) for k, v in vars(style).items())]
              for key, style in plan.items()}
    return json.dumps({"tp_plan": styles, **settings}, sort_keys=True, default=repr)


def agree(description: str, mesh: Mesh) -> None:
    """Refuse, on every rank of the "tp" group, a configuration that differs between them
    (each would wait in collectives the others never make): one all-gather of a digest,
    before the plan is applied (a peer that fails before it ends it when its process
    exits)."""
    import torch.distributed as dist

    digest = torch.frombuffer(bytearray(hashlib.sha256(description.encode()).digest()),
                              dtype=torch.uint8)
    every = digest.new_empty(mesh.tp_size * digest.numel())
    with handed(every, digest):  # see pipeline/comm/handed.py
        dist.all_gather_into_tensor(every, digest, group=mesh.tp)
    seen = every.view(mesh.tp_size, -1)
    differ = [r for r in range(mesh.tp_size) if not torch.equal(seen[r], seen[0])]
    if differ:
        raise PipeConfigError(
            f"the tp ranks at {mesh.coordinates.rsplit(', tp', 1)[0]} disagree on their "
            f"configuration: tp rank(s) {differ} differ from tp rank 0. Every rank must build "
            f"Pipe with the same tp_plan, balance, schedule, chunks and checkpoint; this "
            f"rank's (tp {mesh.tp_rank}): {description}")


def agree_on_seed(seed: int, mesh: Mesh, wait: Callable[[Any, str], None]) -> int:
    """tp rank 0's `seed`, on every rank of the "tp" group: the ranks of a stage's shards run
    one forward, so they draw the same dropout masks (a replicated activation stays equal
    on every tp rank, as on one device) whatever seeds the processes were given."""
    import torch.distributed as dist

    value = torch.tensor([seed], dtype=torch.int64)
    with handed(value):  # see pipeline/comm/handed.py
        work = dist.broadcast(value, group=mesh.tp, group_src=0, async_op=True)
        wait(work, "the step's seed from tp rank 0")
        del work
    return int(value.item())


def grads_as_params(params: Iterable[torch.Tensor]) -> None:
    """Each DTensor gradient laid out as its parameter: a weight every tp rank holds whole
    but computes from a shard of the data (a LayerNorm under SequenceParallel) gets a
    partial-sum gradient from autograd, reduced here over "tp", so that each rank's `.grad`
    holds its shard's (or the whole) gradient, as clipping, dp and optimizers read it. Every
    tp rank calls this for the same parameters, in the same order."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return
    with torch.no_grad():
        for p in params:
            g = p.grad
            if isinstance(g, dtensor.DTensor) and g.placements != getattr(p, "placements", None):
                p.grad = g.redistribute(g.device_mesh, p.placements)  # type: ignore[attr-defined]


def full_tensor(t: Any) -> Any:
    """The whole of a DTensor (a collective over "tp": every tp rank calls it, in the same
    order); anything else as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t.full_tensor()
    return t


def shard_like(current: Any, value: Any) -> Any:
    """`value` (a whole tensor, as the plain model's state_dict has it) as this rank's part
    of `current` when that is a DTensor (cut locally: every rank has the whole value)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if (dtensor is not None and isinstance(current, dtensor.DTensor)
            and isinstance(value, torch.Tensor) and not isinstance(value, dtensor.DTensor)):
        return dtensor.distribute_tensor(value.to(current.device), current.device_mesh,
                                         current.placements, src_data_rank=None)
    return value


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's values) as a gradient for `param`: a DTensor laid out as `param`
    is, under tp; `local` itself otherwise."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(param, dtensor.DTensor):
        made: torch.Tensor = dtensor.DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape,
            stride=param.stride(), run_check=False)
        return made
    return local
