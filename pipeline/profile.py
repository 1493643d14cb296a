"""Per-layer costs of an nn.Sequential (parameters, time, memory) and balances built from them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipeline.memory import SavedBytes
from pipeline.microbatch import as_tuple
from pipeline.partition import partition

__all__ = [
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "layer_params",
    "layer_sizes",
    "layer_times",
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


def _walk(model: nn.Sequential, sample: Any, each: Callable[[nn.Module, tuple[Any, ...]],
                                                             tuple[Any, ...]]) -> None:
    values = as_tuple(sample)
    for layer in model:
        values = each(layer, values)


def _requires_grad(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor)
                 else v for v in values)


def _backward(outputs: tuple[Any, ...]) -> None:
    tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def layer_times(model: nn.Sequential, sample: Any, *, repeats: int = 5,
                warmup: int = 1) -> list[float]:
    """Median forward + backward seconds of each layer on `sample` (one batch or micro-batch).

    Each layer runs on the previous layer's real output, so shapes are the model's own.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 (got {repeats})")
    times: list[float] = []

    def measure(layer: nn.Module, values: tuple[Any, ...]) -> tuple[Any, ...]:
        samples = []
        for i in range(warmup + repeats):
            inputs = _requires_grad(values)
            _sync(inputs)
            start = time.perf_counter()
            outputs = as_tuple(layer(*inputs))
            _backward(outputs)
            _sync(outputs)
            if i >= warmup:
                samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
        layer.zero_grad(set_to_none=True)
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)

    _walk(model, sample, measure)
    return times


def layer_sizes(model: nn.Sequential, sample: Any) -> list[float]:
    """Bytes each layer keeps for training: its parameters (with their gradients) plus the
    activations autograd saves for its backward on `sample`."""
    sizes: list[float] = []

    def measure(layer: nn.Module, values: tuple[Any, ...]) -> tuple[Any, ...]:
        with SavedBytes() as saved:
            outputs = as_tuple(layer(*_requires_grad(values)))
        params = sum(2 * p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(float(saved.bytes + params))
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)

    _walk(model, sample, measure)
    return sizes


def _sync(values: Sequence[Any]) -> None:
    for v in values:
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
