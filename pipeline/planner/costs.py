"""What planning needs measured: per-layer seconds and bytes of a model at each micro-batch size."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from pipeline.runtime.microbatch import leading_rows
from pipeline.runtime.saved_bytes import SavedBytes
from pipeline.runtime.split_backward import backward_input, backward_weight
from pipeline.splitting.profile import detached, fresh_inputs, sync, untouched

__all__ = ["LayerCosts", "ModelProfile", "measure_contention", "parameter_keys", "profile_model"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LayerCosts:
    """Per layer, for micro-batches of `rows` rows: median seconds of the forward, the backward,
    and the backward split into input gradient (I) and weight gradient (W); the bytes of the
    layer's input and of what autograd saves for its backward. The loss (its forward, backward
    and saved tensors) is counted in the last layer, which the last stage always holds."""

    rows: int
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    input_bytes: tuple[float, ...]
    saved_bytes: tuple[float, ...]


@dataclass(frozen=True)
class ModelProfile:
    """A model's measured costs: per layer its parameters (`params[i]`: (key, bytes, trainable)
    for each parameter, a key per distinct Parameter so a weight tied across layers is one
    key) and buffer bytes, and a `LayerCosts` per profiled micro-batch size."""

    num_layers: int
    params: tuple[tuple[tuple[int, int, bool], ...], ...]
    buffer_bytes: tuple[int, ...]
    by_rows: Mapping[int, LayerCosts]
    batch_rows: int
    device: str = "cpu"
    _static: dict[tuple[int, int], tuple[int, int, int]] = field(
        default_factory=dict, repr=False, compare=False)

    def at(self, rows: int) -> LayerCosts:
        """The costs of micro-batches of `rows` rows (profiled at that size)."""
        found = self.by_rows.get(rows)
        if found is None:
            raise KeyError(f"the profile has no micro-batches of {rows} rows (profiled: "
                           f"{sorted(self.by_rows)}); profile_model(..., rows=[{rows}, ...])")
        return found

    def static_bytes(self, start: int, stop: int) -> tuple[int, int, int]:
        """Layers `start..stop-1` as one stage: (bytes of its parameters and buffers, bytes of
        its trainable parameters, number of trainable tensors), each Parameter once."""
        key = (start, stop)
        if key not in self._static:
            seen: set[int] = set()
            total = trainable = count = 0
            for i in range(start, stop):
                total += self.buffer_bytes[i]
                for pid, nbytes, grad in self.params[i]:
                    if pid not in seen:
                        seen.add(pid)
                        total += nbytes
                        trainable += nbytes if grad else 0
                        count += 1 if grad else 0
            self._static[key] = (total, trainable, count)
        return self._static[key]


def _rows(value: Any, rows: int) -> Any:
    return tree_map(lambda v: v[:rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v,
                    value)


def _nbytes(value: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in tree_leaves(value)
                     if isinstance(t, torch.Tensor)))


def _roots(outputs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    return tensors, [torch.ones_like(t) for t in tensors]


class _Clock:
    """Seconds between `start()` and `stop(values)`, waiting for the device where it runs."""

    def __init__(self) -> None:
        self._t = 0.0

    def start(self, values: Any) -> None:
        sync(values)
        self._t = time.perf_counter()

    def stop(self, values: Any) -> float:
        sync(values)
        return time.perf_counter() - self._t


def _layer(layer: nn.Module, value: Any, first: bool, loss: Callable[[Any], torch.Tensor] | None,
           repeats: int, warmup: int) -> tuple[list[float], Any]:
    """[F, B, I, W, input bytes, saved bytes] of one layer on `value`, and its output."""
    params = [p for p in layer.parameters() if p.requires_grad]

    def inputs() -> Any:
        # The first stage's input is the user's batch: it needs no gradient.
        return detached(value) if first else fresh_inputs(value)

    def forward(x: Any) -> Any:
        out = layer(x)
        return loss(out) if loss is not None else out

    clock = _Clock()
    samples: list[list[float]] = [[], [], [], []]
    for i in range(warmup + repeats):
        x = inputs()
        clock.start(x)
        out = forward(x)
        f = clock.stop(out)
        roots, grads = _roots(out)
        clock.start(out)
        if roots:
            torch.autograd.backward(roots, grads)
        b = clock.stop(x)
        x = inputs()
        out = forward(x)
        roots, grads = _roots(out)
        leaves = [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
        ti = tw = 0.0
        if roots:
            clock.start(out)
            got, state = backward_input(roots, grads, leaves, params)
            ti = clock.stop(got)
            clock.start(out)
            backward_weight(state)
            tw = clock.stop(params)
        if i >= warmup:
            for store, t in zip(samples, (f, b, ti, tw), strict=True):
                store.append(t)
    with SavedBytes() as saved:
        out = forward(inputs())
    figures = [statistics.median(s) for s in samples]
    return [*figures, _nbytes(value), float(saved.bytes)], out


def parameter_keys(model: nn.Sequential) -> dict[int, int]:
    """The key `ModelProfile.params` gives each distinct Parameter (by `id`): numbered in the
    order the layers first hold them, so a weight tied across layers has one key."""
    keys: dict[int, int] = {}
    for layer in model:
        for p in layer.parameters(recurse=True):
            keys.setdefault(id(p), len(keys))
    return keys


def profile_model(model: nn.Sequential, sample: Any, target: Any, loss_fn: LossFn, *,
                  rows: Iterable[int] | None = None, repeats: int = 3,
                  warmup: int = 1) -> ModelProfile:
    """Profile each layer of `model` on the first `r` rows of `sample` for each `r` in `rows`
    (default: the whole batch), where the model lives: forward, backward, its input/weight
    split, input and saved bytes; the loss (`loss_fn` on `target`'s rows) counts in the last
    layer. Profile with the thread count and devices you train with. The model is left as it
    was (buffers, gradients, random state)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    batch = leading_rows(sample)
    if batch is None:
        raise ValueError("sample holds no tensor with a batch dimension (dim 0) to profile")
    sizes = sorted(set(rows) if rows is not None else {batch})
    if not sizes or sizes[0] < 1 or sizes[-1] > batch:
        raise ValueError(f"rows must lie in 1..{batch}, the sample's batch (got {sizes})")
    layers = list(model)
    by_rows: dict[int, LayerCosts] = {}
    with untouched(model, (sample, target)):
        for r in sizes:
            value, goal = _rows(sample, r), _rows(target, r)
            table: list[list[float]] = []
            for i, layer in enumerate(layers):
                loss = (lambda out, goal=goal: loss_fn(out, goal)) if i == len(layers) - 1 \
                    else None
                figures, out = _layer(layer, value, i == 0, loss, repeats, warmup)
                table.append(figures)
                value = detached(out)  # the next layer's input (the loss, after the last)
            columns = [tuple(c) for c in zip(*table, strict=True)]
            by_rows[r] = LayerCosts(r, *columns)
    keys = parameter_keys(model)
    params = tuple(tuple((keys[id(p)], p.numel() * p.element_size(), p.requires_grad)
                         for p in layer.parameters(recurse=True)) for layer in layers)
    buffers = tuple(sum(b.numel() * b.element_size() for b in layer.buffers())
                    for layer in layers)
    device = next((str(p.device) for p in model.parameters()), "cpu")
    return ModelProfile(len(layers), params, buffers, by_rows, batch, device)


def measure_contention(model: nn.Sequential, sample: Any, *, ranks: int,
                       seconds: float = 0.3, repeats: int = 3) -> float:
    """How much slower the model's layers compute when `ranks` threads run them at once, each
    its own contiguous share (split by parameters, as a pipeline's ranks would hold them), than
    when each share runs alone: the mean over shares of (time per forward + backward together)
    / (time alone), at least 1; the median of `repeats` measurements. Ranks on CPU share
    cores, caches and memory bandwidth with each other and with whatever else the machine
    runs; the simulator's ranks compute at their profiled speed, so the planner slows the
    overlapped part of each rank's work by this factor. The model is left as it was."""
    if ranks < 1 or repeats < 1 or not seconds > 0:
        raise ValueError(f"ranks and repeats must be >= 1 and seconds > 0 (got {ranks}, "
                         f"{repeats}, {seconds})")
    layers = list(model)
    if ranks == 1 or len(layers) < ranks:
        return 1.0
    from pipeline.splitting.partition import partition
    from pipeline.splitting.profile import layer_params

    bounds = [0]
    for size in partition(layer_params(model), ranks):
        bounds.append(bounds[-1] + size)
    with untouched(model, sample):
        value = sample
        jobs = []
        for r in range(ranks):
            part = nn.Sequential(*layers[bounds[r]:bounds[r + 1]])
            jobs.append((part, value, r == 0))
            with torch.no_grad():
                value = part(detached(value))

        def once(job: tuple[nn.Module, Any, bool]) -> None:
            part, given, first = job
            roots, grads = _roots(part(detached(given) if first else fresh_inputs(given)))
            if roots:
                torch.autograd.backward(roots, grads)

        def rate(chosen: list[int]) -> list[float]:
            """Seconds per forward + backward of each chosen share, all running at once."""
            stop = threading.Event()
            counts = [0] * len(chosen)

            def loop(i: int) -> None:
                while not stop.is_set():
                    once(jobs[chosen[i]])
                    counts[i] += 1

            workers = [threading.Thread(target=loop, args=(i,)) for i in range(len(chosen))]
            start = time.perf_counter()
            for t in workers:
                t.start()
            time.sleep(seconds)
            stop.set()
            for t in workers:
                t.join()
            elapsed = time.perf_counter() - start
            return [elapsed / max(1, c) for c in counts]

        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for job in jobs:
                once(job)  # warm-up
            factors = []
            for _ in range(repeats):
                alone = [rate([r])[0] for r in range(ranks)]
                together = rate(list(range(ranks)))
                factors.append(statistics.fmean(t / a for t, a in zip(together, alone,
                                                                       strict=True)))
        finally:
            torch.set_num_threads(previous)
    return max(1.0, statistics.median(factors))
