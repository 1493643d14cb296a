"""What a heal carries for one rank: its stage's weights and optimizer state, as plain tensors.

Under tp each rank sends and loads its own shards: the peer's rank r holds the same ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from pipeline.parallel.tensor_parallel import local_tensor

__all__ = ["load_model", "load_optimizer", "model_state", "optimizer_state"]


def model_state(pipe: Any) -> dict[str, Any]:
    """This rank's stage weights, detached local tensors (what a heal sends is plain data,
    read with weights_only=True)."""
    return {k: local_tensor(v).detach() for k, v in pipe.state_dict().items()}


def load_model(pipe: Any, state: dict[str, Any]) -> None:
    """A peer's stage weights into this rank's, once checked to be the same model."""
    mine = pipe.state_dict()
    from pipeline.replicas.heal_transport import check_same_model  # needs torchft

    check_same_model(mine, state, local_tensor)
    with torch.no_grad():
        if pipe.mesh is None:
            pipe.load_state_dict(state)
            return
        for k, v in mine.items():
            local_tensor(v).copy_(state[k])


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return dict(tree_map_only(torch.Tensor, local_tensor, optimizer.state_dict()))


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """The peer's optimizer state, its tensors the shards of this rank's parameters:
    a value shaped as its parameter's shard becomes a DTensor laid out as the parameter."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, values in state.get("state", {}).items():
        p = params[int(index)]
        if p is not local_tensor(p):  # a DTensor parameter
            from torch.distributed.tensor import DTensor

            for key, v in list(values.items()):
                if isinstance(v, torch.Tensor) and v.shape == local_tensor(p).shape:
                    values[key] = DTensor.from_local(v, p.device_mesh, p.placements,
                                                     run_check=False)
    optimizer.load_state_dict(state)
