"""Deferred BatchNorm: running statistics gathered over a whole batch and committed once per step.

Without it, a BatchNorm layer in a pipeline updates its running statistics once per micro-batch,
from that micro-batch's rows, so after a step of m micro-batches they have moved m times (as a
plain loop over the micro-batches would move them), not once from the batch. With it, each
training forward still normalises by its own micro-batch's statistics (the gradients are those of
a loop over the micro-batches), but the running mean and variance are left alone until the step
ends, and then updated once per batch from the statistics of all its rows, as a single-device
forward of the whole batch would (torchgpipe's deferred batch norm).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipeline.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "microbatch_scope"]

_state = threading.local()


@contextmanager
def microbatch_scope(index: int) -> Iterator[None]:
    """Marks the micro-batch a forward computes (the runtime sets it around every forward)."""
    previous = getattr(_state, "microbatch", None)
    _state.microbatch = index
    try:
        yield
    finally:
        _state.microbatch = previous


class _Sums:
    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        dims = [d for d in range(x.dim()) if d != 1]
        x = x.detach().double()  # float64 sums: the variance below subtracts two of them
        total, squares = x.sum(dims), (x * x).sum(dims)
        self.total = total if self.total is None else self.total + total
        self.squares = squares if self.squares is None else self.squares + squares
        self.count += x.numel() // x.shape[1]


class DeferredBatchNorm:
    """Hooks on every BatchNorm layer of `modules` that keep training forwards from updating
    the running statistics, gather the batch's statistics instead, and `commit` them."""

    def __init__(self, modules: Iterable[nn.Module], chunks: int) -> None:
        self.chunks = chunks
        self.layers = [m for root in modules for m in root.modules()
                       if isinstance(m, _BatchNorm) and m.track_running_stats]
        self._sums: dict[tuple[int, int], _Sums] = {}  # (layer, batch) -> sums
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._before(i))
            layer.register_forward_hook(self._after)

    def _before(self, i: int) -> Any:
        def hook(module: _BatchNorm, args: tuple[Any, ...]) -> None:
            if not module.training:
                return
            module.track_running_stats = False  # this forward: batch statistics, no update
            if not is_recomputing():  # a replay's rows were counted by its forward
                batch = (getattr(_state, "microbatch", None) or 0) // self.chunks
                self._sums.setdefault((i, batch), _Sums()).add(args[0])
        return hook

    @staticmethod
    def _after(module: _BatchNorm, args: tuple[Any, ...], output: Any) -> None:
        module.track_running_stats = True

    def begin(self) -> None:
        """Forget what a failed step gathered."""
        self._sums.clear()

    @torch.no_grad()
    def commit(self) -> None:
        """Update each layer's running statistics once per batch gathered, in batch order."""
        for (i, _), sums in sorted(self._sums.items()):
            layer = self.layers[i]
            assert sums.total is not None and sums.squares is not None
            assert layer.running_mean is not None and layer.running_var is not None
            n = sums.count
            mean = sums.total / n
            var = (sums.squares / n - mean * mean).clamp_(min=0) * (n / max(n - 1, 1))
            assert layer.num_batches_tracked is not None
            layer.num_batches_tracked.add_(1)
            factor = (layer.momentum if layer.momentum is not None
                      else 1.0 / float(layer.num_batches_tracked))
            layer.running_mean.mul_(1 - factor).add_(factor * mean.to(layer.running_mean))
            layer.running_var.mul_(1 - factor).add_(factor * var.to(layer.running_var))
        self._sums.clear()
