"""Per-layer costs of an nn.Sequential (parameters, time, memory) and balances built from them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from pipeline.runtime.saved_bytes import SavedBytes
from pipeline.splitting.partition import partition

__all__ = [
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "detached",
    "fresh_inputs",
    "layer_params",
    "layer_sizes",
    "layer_times",
    "sync",
    "untouched",
]


def layer_params(model: nn.Sequential) -> list[float]:
    """Parameter count of each layer (shared parameters counted where first seen)."""
    seen: set[int] = set()
    counts = []
    for layer in model:
        total = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        counts.append(float(total))
    return counts


@contextmanager
def untouched(model: nn.Module, sample: Any) -> Iterator[None]:
    """Run the model for real, then put back what running it changes: buffers (BatchNorm's
    running statistics and `num_batches_tracked`), every `.grad` (the objects themselves, not
    copies, so an optimizer holding them sees nothing) and the random streams dropout drew from.
    Cheaper than profiling a copy, which would double the model's memory."""
    buffers = [(module, name, b, b.detach().clone()) for module in model.modules()
               for name, b in module.named_buffers(recurse=False)]
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None  # backward accumulates in place: keep the caller's tensors out of reach
    devices = sorted({t.device.index or 0 for t in [*params, *tree_leaves(sample)]
                      if isinstance(t, torch.Tensor) and t.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for module, name, b, saved in buffers:
                b.copy_(saved)
                setattr(module, name, b)  # in case a layer rebound the attribute
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def _walk(model: nn.Sequential, sample: Any, each: Callable[[nn.Module, Any], Any]) -> None:
    """Each layer gets the previous layer's output as one argument, exactly as nn.Sequential
    (and the stage runtime) calls it: a tuple stays a tuple, a 1-tuple stays a 1-tuple."""
    with untouched(model, sample):
        value = sample
        for layer in model:
            value = each(layer, value)


def fresh_inputs(value: Any) -> Any:
    """`value` cut from the graph, floating tensors requiring grad (so the input gradient is
    part of the measured backward). The leaf is cloned: an in-place layer (ReLU(inplace=True))
    may then write to its input, as it does inside a model."""
    def fresh(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if not v.is_floating_point():
            return v.detach()
        return v.detach().requires_grad_(True).clone()
    return tree_map(fresh, value)


def detached(value: Any) -> Any:
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def _backward(outputs: Any) -> None:
    tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def layer_times(model: nn.Sequential, sample: Any, *, repeats: int = 5,
                warmup: int = 1) -> list[float]:
    """Median forward + backward seconds of each layer on `sample` (one batch or micro-batch).

    Each layer runs on the previous layer's real output, so shapes are the model's own. The
    model is left as it was (see `untouched`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 (got {repeats})")
    times: list[float] = []

    def measure(layer: nn.Module, value: Any) -> Any:
        samples = []
        for i in range(warmup + repeats):
            inputs = fresh_inputs(value)
            sync(inputs)
            start = time.perf_counter()
            outputs = layer(inputs)
            _backward(outputs)
            sync(outputs)
            if i >= warmup:
                samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
        return detached(outputs)

    _walk(model, sample, measure)
    return times


def layer_sizes(model: nn.Sequential, sample: Any) -> list[float]:
    """Bytes each layer keeps for training: its parameters (with their gradients) plus the
    activations autograd saves for its backward on `sample`. The model is left as it was."""
    sizes: list[float] = []

    def measure(layer: nn.Module, value: Any) -> Any:
        inputs = fresh_inputs(value)
        with SavedBytes() as saved:
            outputs = layer(inputs)
        params = sum(2 * p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(float(saved.bytes + params))
        return detached(outputs)

    _walk(model, sample, measure)
    return sizes


def sync(values: Any) -> None:
    for v in tree_leaves(values):
        if isinstance(v, torch.Tensor) and v.is_cuda:
            torch.cuda.synchronize(v.device)
            return


def balance_by_params(model: nn.Sequential, num_stages: int) -> list[int]:
    """Layers per stage minimising the largest stage's parameter count."""
    return partition(layer_params(model), num_stages)


def balance_by_time(model: nn.Sequential, sample: Any, num_stages: int, *,
                    repeats: int = 5) -> list[int]:
    """Layers per stage minimising the slowest stage's profiled forward + backward time."""
    return partition(layer_times(model, sample, repeats=repeats), num_stages)


def balance_by_size(model: nn.Sequential, sample: Any, num_stages: int) -> list[int]:
    """Layers per stage minimising the largest stage's parameter + activation memory."""
    return partition(layer_sizes(model, sample), num_stages)
