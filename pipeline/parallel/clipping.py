"""Global gradient clipping: one norm over every stage of every rank, each tied weight once."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from pipeline.parallel.tensor_parallel import full_tensor, local_tensor

__all__ = ["clip_grad_norm"]

Exchange = Callable[[str], list[str]]  # every rank's payload, in rank order


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                   *, error_if_nonfinite: bool = False,
                   exchange: Exchange | None = None) -> torch.Tensor:
    """As `torch.nn.utils.clip_grad_norm_` over the whole model: the total norm of every
    gradient (on every rank, when `exchange` joins the ranks) and the same scaling of each.

    The norm is computed as torch computes it (each gradient's norm, then the norm of those),
    so it equals the plain model's up to the order of the terms. Returns it as a CPU tensor.
    A DTensor's norm (a shard of a weight under tp or FSDP2) is its whole tensor's, reduced
    over the ranks holding its shards, as torch's clipping reduces it; every such rank calls
    this for the same parameters.
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    # Each norm in its gradient's dtype, as torch keeps it: a float64 model's norm is float64.
    norms = [full_tensor(torch.linalg.vector_norm(g.detach(), norm_type)).cpu() for g in grads]
    if exchange is not None:
        # Exact round trip: float.hex of the value (a Python float holds every float dtype's
        # values exactly) beside its dtype; every rank then stacks the same list in rank order.
        payload = ",".join(f"{_dtype_name(n.dtype)}:{float(n).hex()}" for n in norms)
        norms = [_from_text(v) for part in exchange(payload) for v in part.split(",") if v]
    if not norms:
        return torch.tensor(0.0)
    # torch.stack promotes mixed dtypes (bf16 and fp32 norms: the total in fp32), as torch's own
    # clipping stacks its per-gradient norms.
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}, so they cannot be clipped; pass "
                           f"error_if_nonfinite=False to clip anyway (a GradScaler's "
                           f"step then skips the update)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:  # each shard scaled in place: the whole gradient scaled
        local_tensor(g).detach().mul_(coef.to(g.device, g.dtype))
    return total


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _from_text(item: str) -> torch.Tensor:
    """A norm from its exchanged text `dtype:hex` (a peer of this job wrote it)."""
    name, _, value = item.partition(":")
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype) and dtype.is_floating_point, item
    return torch.tensor(float.fromhex(value), dtype=dtype)
