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
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from pipeline.errors import PipeConfigError, PipeTypeError
from pipeline.runtime.recompute import is_recomputing

__all__ = ["MODES", "DeferredBatchNorm", "check_mode", "microbatch_scope"]

_state = threading.local()


class _Scope:
    # A plain class, not @contextmanager: it is entered around every forward.
    __slots__ = ("index", "previous")

    def __init__(self, index: int) -> None:
        self.index = index
        self.previous: int | None = None

    def __enter__(self) -> None:
        self.previous = getattr(_state, "microbatch", None)
        _state.microbatch = self.index

    def __exit__(self, *exc: object) -> None:
        _state.microbatch = self.previous


def microbatch_scope(index: int) -> AbstractContextManager[None]:
    """Marks the micro-batch a forward computes (the runtime sets it around the forwards of
    stages that hold a BatchNorm layer, the only readers: deferred BatchNorm's hooks)."""
    return _Scope(index)


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


MODES = (False, True, "global")


def check_mode(value: object) -> bool | str:
    """`deferred_batch_norm`'s value, checked."""
    if not isinstance(value, bool | str):
        raise PipeTypeError(f"deferred_batch_norm must be True, False or 'global' (got "
                            f"{type(value).__name__} {value!r})")
    if value not in MODES:
        raise PipeConfigError(
            f"deferred_batch_norm must be one of {MODES} (got {value!r}): True gathers each "
            f"replica's batch, 'global' the whole global batch over the mesh's 'dp' dimension")
    return value


class DeferredBatchNorm:
    """Hooks on every BatchNorm layer of `modules` that keep training forwards from updating
    the running statistics, gather the batch's statistics instead, and `commit` them.

    With `reduce` (a sum over the replicas, in place), `commit` first adds up every replica's
    sums, so each replica commits the global batch's statistics (SyncBatchNorm's running
    statistics). The hooks live as long as this object: `remove()` (the Pipe's `close()`)
    takes them off, and so does collecting it, since they hold it only weakly.
    """

    def __init__(self, modules: Iterable[nn.Module], chunks: int, *,
                 reduce: Callable[[torch.Tensor, str], None] | None = None) -> None:
        self.chunks = chunks
        self.reduce = reduce
        self.layers = [m for root in modules for m in root.modules()
                       if isinstance(m, _BatchNorm) and m.track_running_stats]
        self._sums: dict[tuple[int, int], _Sums] = {}  # (layer, batch) -> sums
        me = weakref.ref(self)
        handles = []
        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(_before(me, i)))
            # always_call: a forward that raised still tracks statistics again afterwards
            handles.append(layer.register_forward_hook(_after, always_call=True))
        self.remove = weakref.finalize(self, _remove, handles)

    def begin(self) -> None:
        """Forget what a failed step gathered."""
        self._sums.clear()

    @torch.no_grad()
    def commit(self) -> None:
        """Update each layer's running statistics once per batch gathered, in batch order."""
        gathered = sorted(self._sums.items())
        self._sums.clear()
        if self.reduce is not None and gathered:
            self._reduce([sums for _, sums in gathered])
        for (i, _), sums in gathered:
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

    def _reduce(self, gathered: list[_Sums]) -> None:
        """Every replica's sums and row counts added up: one float64 all-reduce."""
        assert self.reduce is not None
        parts = [t for s in gathered for t in (s.total, s.squares) if t is not None]
        counts = torch.tensor([float(s.count) for s in gathered], dtype=torch.float64,
                              device=parts[0].device)
        flat = torch.cat([*parts, counts])
        self.reduce(flat, "deferred BatchNorm's statistics over dp")
        offset = 0
        for s in gathered:
            assert s.total is not None and s.squares is not None
            for t in (s.total, s.squares):
                t.copy_(flat[offset:offset + t.numel()])
                offset += t.numel()
        for s, count in zip(gathered, flat[offset:].tolist(), strict=True):
            s.count = round(count)  # float64 holds row counts exactly


def _before(me: weakref.ref[DeferredBatchNorm], i: int) -> Any:
    def hook(module: _BatchNorm, args: tuple[Any, ...]) -> None:
        deferred = me()
        if deferred is None or not module.training:
            return
        module.track_running_stats = False  # this forward: batch statistics, no update
        if not is_recomputing():  # a replay's rows were counted by its forward
            batch = (getattr(_state, "microbatch", None) or 0) // deferred.chunks
            deferred._sums.setdefault((i, batch), _Sums()).add(args[0])
    return hook


def _after(module: _BatchNorm, args: tuple[Any, ...], output: Any) -> None:
    module.track_running_stats = True


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
