"""Global gradient clipping: one norm over every stage of every rank, each tied weight once."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from pipeline.parallel.tensor_parallel import local_tensor, sharded_params

__all__ = ["clip_grad_norm"]

Exchange = Callable[[str], list[str]]  # every rank's payload, in rank order
Gather = Callable[[torch.Tensor], torch.Tensor]  # (k,) on each tp rank -> (tp, k), rank order


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                   *, error_if_nonfinite: bool = False,
                   exchange: Exchange | None = None,
                   over_tp: Gather | None = None) -> torch.Tensor:
    """As `torch.nn.utils.clip_grad_norm_` over the whole model: the total norm of every
    gradient (on every rank, when `exchange` joins the ranks) and the same scaling of each.

    The norm is computed as torch computes it (each gradient's norm, then the norm of those),
    so it equals the plain model's up to the order of the terms. Returns it as a CPU tensor.
    Under tensor parallelism (`over_tp` gathers over the "tp" group), a sharded weight's norm
    is the norm of its shards' norms, and a weight every tp rank holds whole counts once.
    """
    norm_type = float(norm_type)
    params = [p for p in parameters if p.grad is not None]
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).float().cpu() for g in grads]
    if over_tp is not None and norms:
        every = over_tp(torch.stack(norms))  # the same parameters on every tp rank
        norms = [torch.linalg.vector_norm(every[:, i], norm_type) if sharded else every[0, i]
                 for i, sharded in enumerate(sharded_params(params))]
    if exchange is not None:
        # Exact round trip: float.hex; every rank then stacks the same list in rank order.
        payload = ",".join(float(n).hex() for n in norms)
        norms = [torch.tensor(float.fromhex(v)) for part in exchange(payload)
                 for v in part.split(",") if v]
    if not norms:
        return torch.tensor(0.0)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}, so they cannot be clipped; pass "
                           f"error_if_nonfinite=False to clip anyway (a GradScaler's "
                           f"step then skips the update)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
