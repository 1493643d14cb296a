"""Loss scaling across processes: every rank's GradScaler skips a step when any rank overflowed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.comm.handed import handed

__all__ = ["agree_on_overflow"]


def agree_on_overflow(scaler: Any, parameters: Sequence[nn.Parameter], device: torch.device,
                      group: Any) -> None:
    """After a step, make this rank's `scaler` see an overflow if any rank of `group` had one.

    A GradScaler decides from the gradients it unscales, and each rank holds only its own
    stages' gradients: an inf on one rank would skip the step there and not elsewhere, and the
    scales would drift apart. The ranks all-reduce whether they found a non-finite gradient; a
    rank whose own gradients are finite then marks one of them inf, so its `scaler.step` skips
    and its `scaler.update` backs off exactly as the others do.
    """
    scaler.scale(torch.zeros((), device=device))  # ranks without the loss start the scale
    grads = [p.grad for p in parameters if p.grad is not None]
    found = torch.zeros(1, device=device)
    finite = not grads or bool(torch.stack([g.isfinite().all() for g in grads]).all())
    if not finite:
        found.fill_(1.0)
    with handed(found):  # see pipeline/comm/handed.py
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    if found.item() and finite and grads:
        grads[0].view(-1)[0] = float("inf")
