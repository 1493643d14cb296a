"""Collectives over the pipeline's own transport: a result to every rank, a state_dict to one.

They use point-to-point messages with the transport's failure-aware waits rather than
torch.distributed collectives: a collective would hang on a rank that failed after this one
finished its actions.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.comm.process_group import ProcessTransport

__all__ = ["gather_state_dict", "share"]


def share(transport: ProcessTransport, values: torch.Tensor | None, src: int,
          num_ranks: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`values` from rank `src` to every rank, point to point, with the failure-aware waits
    (a collective would hang on a rank that failed after this one finished its actions)."""
    if transport.rank == src:
        assert values is not None
        for dst in range(num_ranks):
            if dst != src:
                transport.send_result(values, dst)
        transport.finish()
        return values
    # On this rank's device: results of CUDA ranks over gloo arrive in host memory.
    return transport.recv_result(src, shape).to(transport.device)


def gather_state_dict(full_model: nn.Module, local: dict[str, torch.Tensor],
                      owner_of: dict[str, int], transport: ProcessTransport,
                      dst: int) -> dict[str, torch.Tensor] | None:
    """The whole model's state_dict on rank `dst` (None elsewhere), keys as in the model.

    Every rank knows every key, shape and dtype from the model's structure (built on any device,
    meta included), so only raw tensors travel, in key order.
    """
    structure = full_model.state_dict()
    if transport.rank != dst:
        for key in structure:
            if owner_of[key] == transport.rank:
                transport.send_result(local[key].detach().cpu(), dst)
        transport.finish()
        return None
    out: dict[str, torch.Tensor] = {}
    for key, spec in structure.items():
        if owner_of[key] == dst:
            out[key] = local[key].detach().cpu()
        else:
            out[key] = transport.recv_result(owner_of[key], tuple(spec.shape), spec.dtype)
    return out
