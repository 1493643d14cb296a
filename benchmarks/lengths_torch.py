"""The lengths suite's peer: torch.distributed.pipelining on the same Llama-style split."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.torch_baseline import TorchPipeline
from pipeline import Pipe

__all__ = ["CountedLoss", "TorchStage", "check", "step", "torch_peer"]


class TorchStage(nn.Module):
    """One stage's layers (the model's own) for torch: torch passes a stage's tuple output
    `(hidden, mask)` to the next stage as positional inputs, the layers take it as one tuple."""

    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, *xs: Any) -> Any:
        return self.layers(xs[0] if len(xs) == 1 else xs)


class CountedLoss:
    """Torch's per-micro-batch loss for the batch's token-weighted mean: torch averages its
    micro-batches' losses (and divides the gradients by their number), so each one is its
    summed cross-entropy x m / the batch's counted tokens (`total`, set before each step)."""

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.total = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return summed * (self.num_microbatches / self.total)

    def batch_loss(self, losses: Sequence[torch.Tensor]) -> float:
        """The batch's loss from torch's per-micro-batch losses (their mean)."""
        return float(sum(float(v.detach()) for v in losses) / self.num_microbatches)


def torch_peer(net: nn.Sequential, balance: Sequence[int], *, rank: int, chunks: int,
               group: Any) -> tuple[TorchPipeline, CountedLoss]:
    """Torch's stages over `net`'s own layers with our partition, under Schedule1F1B."""
    loss = CountedLoss(chunks)
    peer = TorchPipeline(net, balance, schedule="1f1b", rank=rank, num_ranks=len(balance),
                         num_microbatches=chunks, loss_fn=loss, device=torch.device("cpu"),
                         group=group, stage_module=TorchStage)
    return peer, loss


def step(peer: TorchPipeline, x: tuple[torch.Tensor, ...], labels: torch.Tensor,
         losses: list[torch.Tensor] | None = None) -> None:
    """One step of torch's: the first stage's rank feeds x's tensors as positional inputs
    (torch takes no tuple), the last's the labels (and gets each micro-batch's loss)."""
    args = x if peer.first else ()
    if peer.last:
        peer.schedule.step(*args, target=labels, losses=losses)
    else:
        peer.schedule.step(*args)


def check(pipe: Pipe, peer: TorchPipeline, loss: CountedLoss, net: nn.Sequential,
          x: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor,
          ours_loss: Any) -> dict[str, float | None]:
    """One batch through ours and torch's from zeroed gradients: both losses (this rank's, None
    where it holds no last stage), the largest gradient difference on this rank's layers and how
    many parameters were compared. `ours_loss(x, labels)` steps ours and returns its loss."""
    net.zero_grad(set_to_none=True)
    ours = float(ours_loss(x, labels))
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    loss.total = int((labels != -100).sum())
    losses: list[torch.Tensor] = []
    step(peer, x, labels, losses)
    theirs = loss.batch_loss(losses) if peer.last else None
    diff = 0.0
    for name, param in net.named_parameters():
        if name in grads:
            got = param.grad if param.grad is not None else torch.zeros_like(grads[name])
            diff = max(diff, float((got - grads[name]).abs().max()))
        elif param.grad is not None:  # torch's stages took a gradient ours did not
            diff = max(diff, float(param.grad.abs().max()))
    net.zero_grad(set_to_none=True)
    return {"ours_loss": ours if peer.last else None, "torch_loss": theirs,
            "max_grad_diff": diff, "compared": len(grads)}
