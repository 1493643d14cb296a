"""What Pipe needs to be one rank of many: the world, devices, local layers, shared results."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.distributed import DistributedTransport

__all__ = ["gather_state_dict", "materialize", "rank_devices", "share", "world"]


def world(group: Any = None) -> tuple[int, int] | None:
    """(rank, world size) when running as one of several processes, else None.

    Uses an initialised process group, or initialises one from torchrun's environment
    (`WORLD_SIZE` > 1): gloo, or NCCL when CUDA is available.
    """
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=5))
    size = dist.get_world_size(group)
    if size == 1 and group is None:
        return None
    return dist.get_rank(group), size


def rank_devices(devices: Sequence[str | torch.device] | None, num_ranks: int,
                 rank: int) -> list[torch.device]:
    """One device per rank; only this rank's entry is used. Default: this process's GPU
    (`cuda:LOCAL_RANK`) under NCCL, the CPU under gloo."""
    if devices is not None:
        return [torch.device(d) for d in devices]
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        mine = torch.device("cuda", local)
    else:
        mine = torch.device("cpu")
    return [mine if r == rank else torch.device("cpu") for r in range(num_ranks)]


def materialize(layer: nn.Module, device: torch.device) -> nn.Module:
    """Put `layer` on `device`; a layer built on the meta device gets real storage there and
    its own initialisers (`reset_parameters`), so no rank ever builds the whole model."""
    on_meta = any(t.is_meta for t in [*layer.parameters(), *layer.buffers()])
    if not on_meta:
        return layer.to(device)
    layer.to_empty(device=device)
    for module in layer.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    return layer


def share(transport: DistributedTransport, values: torch.Tensor | None, src: int,
          num_ranks: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`values` from rank `src` to every rank, point to point, with the failure-aware waits
    (a collective would hang on a rank that failed after this one finished its actions)."""
    if transport.rank == src:
        assert values is not None
        for dst in range(num_ranks):
            if dst != src:
                transport.send("S", 0, 0, (values,), dst)
        transport.finish()
        return values
    return transport.recv_direct(src, shape)


def gather_state_dict(full_model: nn.Module, local: dict[str, torch.Tensor],
                      owner_of: dict[str, int], transport: DistributedTransport,
                      dst: int) -> dict[str, torch.Tensor] | None:
    """The whole model's state_dict on rank `dst` (None elsewhere), keys as in the model.

    Every rank knows every key, shape and dtype from the model's structure (built on any device,
    meta included), so only raw tensors travel, in key order.
    """
    structure = full_model.state_dict()
    if transport.rank != dst:
        for key in structure:
            if owner_of[key] == transport.rank:
                transport.send("S", 0, 0, (local[key].detach().cpu(),), dst)
        transport.finish()
        return None
    out: dict[str, torch.Tensor] = {}
    for key, spec in structure.items():
        if owner_of[key] == dst:
            out[key] = local[key].detach().cpu()
        else:
            out[key] = transport.recv_direct(owner_of[key], tuple(spec.shape),
                                             values_dtype=spec.dtype)
    return out
