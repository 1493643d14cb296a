"""What planning needs measured: per-layer seconds and bytes of a model at each micro-batch size."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from pipeline.planner import contention
from pipeline.planner.progress import SILENT, Progress
from pipeline.runtime.microbatch import leading_rows
from pipeline.runtime.saved_bytes import SavedBytes
from pipeline.runtime.split_backward import backward_input, backward_weight
from pipeline.splitting.profile import detached, fresh_inputs, sync, untouched

__all__ = ["LayerCosts", "ModelProfile", "measure_contention", "parameter_keys", "profile_model"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LayerCosts:
    """Per layer, for micro-batches of `rows` rows: seconds of the forward, the backward,
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
    """Seconds between `start()` and `stop(values)`. On CPU with one torch thread the work
    runs on the calling thread, so its CPU time is what it costs, whatever else the machine
    runs (a busy machine only makes it wait for a core); elsewhere (several threads, a GPU)
    the wall time, waiting for the device."""

    def __init__(self, cpu: bool) -> None:
        self._read = contention.thread_seconds if cpu else time.perf_counter
        self._cuda = not cpu
        self._t = 0.0

    def start(self, values: Any) -> None:
        if self._cuda:
            sync(values)
        self._t = self._read()

    def stop(self, values: Any) -> float:
        if self._cuda:
            sync(values)
        return self._read() - self._t


def _on_one_thread(model: nn.Module) -> bool:
    """Whether a layer's work runs on the calling thread alone: CPU tensors, one torch
    thread."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    return on_cpu and torch.get_num_threads() == 1


class _Layer:
    """One layer on its input, timed a pass at a time: [F, B, I, W] of each pass."""

    def __init__(self, layer: nn.Module, value: Any, first: bool,
                 loss: Callable[[Any], torch.Tensor] | None, clock: _Clock) -> None:
        self.layer, self.value, self.first, self.loss, self.clock = (layer, value, first, loss,
                                                                     clock)
        self.params = [p for p in layer.parameters() if p.requires_grad]

    def inputs(self) -> Any:
        # The first stage's input is the user's batch: it needs no gradient.
        return detached(self.value) if self.first else fresh_inputs(self.value)

    def forward(self, x: Any) -> Any:
        out = self.layer(x)
        return self.loss(out) if self.loss is not None else out

    def once(self) -> list[float]:
        clock = self.clock
        x = self.inputs()
        clock.start(x)
        out = self.forward(x)
        f = clock.stop(out)
        roots, grads = _roots(out)
        clock.start(out)
        if roots:
            torch.autograd.backward(roots, grads)
        b = clock.stop(x)
        x = self.inputs()
        out = self.forward(x)
        roots, grads = _roots(out)
        leaves = [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
        ti = tw = 0.0
        if roots:
            clock.start(out)
            got, state = backward_input(roots, grads, leaves, self.params)
            ti = clock.stop(got)
            clock.start(out)
            backward_weight(state)
            tw = clock.stop(self.params)
        return [f, b, ti, tw]

    def sizes(self) -> tuple[list[float], Any]:
        """[input bytes, saved bytes] and the layer's output (the next layer's input)."""
        with SavedBytes() as saved:
            out = self.forward(self.inputs())
        return [_nbytes(self.value), float(saved.bytes)], out


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
                  warmup: int = 1, progress: Progress = SILENT) -> ModelProfile:
    """Profile each layer of `model` on the first `r` rows of `sample` for each `r` in `rows`
    (default: the whole batch), where the model lives: forward, backward, its input/weight
    split, input and saved bytes; the loss (`loss_fn` on `target`'s rows) counts in the last
    layer. Each figure is the least of `repeats` passes, interleaved over the layers; on CPU
    with one torch thread it is the thread's CPU time, so other programs' load does not move
    it (elsewhere, wall time). Profile with the thread count and devices you train with.
    `progress` hears of each pass. The model is left as it was (buffers, gradients, random
    state)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    batch = leading_rows(sample)
    if batch is None:
        raise ValueError("sample holds no tensor with a batch dimension (dim 0) to profile")
    sizes = sorted(set(rows) if rows is not None else {batch})
    if not sizes or sizes[0] < 1 or sizes[-1] > batch:
        raise ValueError(f"rows must lie in 1..{batch}, the sample's batch (got {sizes})")
    layers = list(model)
    clock = _Clock(_on_one_thread(model))
    progress.phase("profiling", len(sizes) * (warmup + repeats))
    by_rows: dict[int, LayerCosts] = {}
    with untouched(model, (sample, target)):
        for r in sizes:
            value, goal = _rows(sample, r), _rows(target, r)
            timed: list[_Layer] = []
            sizes_of: list[list[float]] = []
            for i, layer in enumerate(layers):
                loss = (lambda out, goal=goal: loss_fn(out, goal)) if i == len(layers) - 1 \
                    else None
                timed.append(_Layer(layer, value, i == 0, loss, clock))
                nbytes, out = timed[-1].sizes()
                sizes_of.append(nbytes)
                value = detached(out)  # the next layer's input (the loss, after the last)
            # Repeats interleaved over the layers, the least of each kept: a burst of other
            # work lands on one pass of several layers, not on every pass of one, and a
            # pass's least time is the closest to what the layer itself costs.
            passes: list[list[list[float]]] = [[] for _ in layers]
            for n in range(warmup + repeats):
                for i, one in enumerate(timed):
                    got = one.once()
                    if n >= warmup:
                        passes[i].append(got)
                progress.advance()
            table = [[min(column) for column in zip(*runs, strict=True)] + nbytes
                     for runs, nbytes in zip(passes, sizes_of, strict=True)]
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
    when each share runs alone: the mean over shares of (CPU time per forward + backward
    together) / (CPU time alone), each the least of `repeats` interleaved measurements, times
    ranks / cores where the ranks outnumber the cores (they then take turns on them); at least
    1. Ranks on CPU share caches and memory bandwidth, which their CPU time shows; each
    thread's own CPU time leaves out what other programs take of the machine (they make it
    wait, not work), so the factor is the same on an idle machine and a busy one. The
    simulator's ranks compute at their profiled speed, so the planner slows the overlapped part
    of each rank's work by this factor. The model is left as it was."""
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
            """CPU seconds per forward + backward of each chosen share, all running at once."""
            stop = threading.Event()
            counts = [0] * len(chosen)
            spent = [0.0] * len(chosen)

            def loop(i: int) -> None:
                begin = contention.thread_seconds()
                while not stop.is_set():
                    once(jobs[chosen[i]])
                    counts[i] += 1
                spent[i] = contention.thread_seconds() - begin

            workers = [threading.Thread(target=loop, args=(i,)) for i in range(len(chosen))]
            for t in workers:
                t.start()
            time.sleep(seconds)
            stop.set()
            for t in workers:
                t.join()
            return [cpu / max(1, c) for cpu, c in zip(spent, counts, strict=True)]

        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for job in jobs:
                once(job)  # warm-up
            alone = [math.inf] * ranks
            together = [math.inf] * ranks
            for _ in range(repeats):
                for r in range(ranks):
                    alone[r] = min(alone[r], rate([r])[0])
                together = [min(a, b) for a, b in zip(together, rate(list(range(ranks))),
                                                       strict=True)]
        finally:
            torch.set_num_threads(previous)
    shared = statistics.fmean(t / a for t, a in zip(together, alone, strict=True))
    return max(1.0, shared * max(1.0, ranks / contention.cores()))
