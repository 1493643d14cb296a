"""Recomputation and RNG replay: a micro-batch's forward can run again, drawing the same randoms.

Every forward of stage s on micro-batch m runs under a generator seeded from (step seed, s, m),
so dropout masks depend on neither the schedule, nor the recompute mode, nor thread timing.
A checkpointed forward keeps only its inputs and is replayed under the same seed right before
its backward. A device's generator is shared by every worker thread on that device (the CPU
generator by all CPU ranks, a GPU's by the ranks placed on it): stages that draw from it run
their forward under that device's lock (found out on their first forward), the others freely.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

__all__ = ["CHECKPOINT_MODES", "BufferGuard", "RngReplay", "is_recomputing", "mode_key",
           "stage_seed"]

CHECKPOINT_MODES = ("never", "except_last", "always")
T = TypeVar("T")
_state = threading.local()
_CPU_RNG_LOCK = threading.Lock()
_CUDA_RNG_LOCKS: dict[int, threading.Lock] = {}  # per CUDA device index


def is_recomputing() -> bool:
    """True inside the replayed forward of a checkpointed micro-batch (e.g. to skip updating
    running statistics twice)."""
    return bool(getattr(_state, "recomputing", False))


@contextmanager
def recomputing() -> Iterator[None]:
    previous = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous


def stage_seed(step_seed: int, stage: int, microbatch: int) -> int:
    """A well-mixed 63-bit seed for (step, stage, micro-batch) (splitmix64 finaliser)."""
    x = (step_seed * 0x9E3779B97F4A7C15 + stage * 0xBF58476D1CE4E5B9 + microbatch + 1)
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def mode_key(stage: int, module: nn.Module) -> tuple[int, tuple[bool, ...]]:
    """What decides whether a stage's forward draws randoms or changes buffers: the stage and
    every one of its modules' training flags (`pipe.eval()` switches the layers, not the
    stage's container, and a user may switch a single layer)."""
    return stage, tuple(m.training for m in module.modules())


class BufferGuard:
    """Keeps a replayed forward from changing buffers (BatchNorm's running statistics).

    A stage's first forward of each mode records which buffers it changed; a replay saves
    those few, runs, and puts them back, so the running statistics are updated once per
    micro-batch, by its forward, as without recomputation.
    """

    def __init__(self) -> None:
        self._changes: dict[Hashable, list[str]] = {}

    def known(self, key: Hashable) -> bool:
        """Whether a forward of this mode has run: which buffers it changes is known."""
        return key in self._changes

    def forward(self, key: Hashable, module: nn.Module, fn: Callable[[], T]) -> T:
        if key in self._changes:
            return fn()
        # By value, once per mode: native kernels (batch_norm) update running statistics in
        # place without moving the tensors' version counters.
        buffers = dict(module.named_buffers())
        before = {name: b.detach().clone() for name, b in buffers.items()}
        out = fn()
        self._changes[key] = [n for n, b in buffers.items() if not torch.equal(b, before[n])]
        return out

    def replay(self, key: Hashable, module: nn.Module, fn: Callable[[], T]) -> T:
        names = self._changes.get(key)
        if names is None:  # no forward of this mode seen (cannot happen in a step): learn now
            names = [n for n, _ in module.named_buffers()]
        buffers = dict(module.named_buffers())
        saved = {n: buffers[n].detach().clone() for n in names}
        try:
            return fn()
        finally:
            # Through `.data`: the replay's graph saved these buffers (batch_norm's backward
            # takes them), and a visible in-place change would fail its version check.
            for n, value in saved.items():
                buffers[n].data.copy_(value)


class RngReplay:
    """Runs a stage's forward under its (step, stage, micro-batch) seed on one device.

    The generator is the device's own (the process's CPU generator, or the CUDA device's), and
    ranks that share a device share it: a forward that draws from it holds that device's lock
    from seeding to restoring, so no other rank's draws interleave and the same seed gives the
    same masks whatever the thread timing. Whether a forward draws at all is found out on its
    first run (the generator's state moved); forwards that never draw run without the lock.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # mode_key(...) -> whether that forward draws from the device's generator.
        self._draws: dict[Hashable, bool] = {}

    def quiet(self, key: Hashable) -> bool:
        """Whether forwards of this mode are known to draw nothing (they run unseeded)."""
        return self._draws.get(key) is False

    def run(self, key: Hashable, seeds: tuple[int, int, int], fn: Callable[[], T]) -> T:
        """`fn()` under the seed of `seeds` (step seed, stage, micro-batch; see `stage_seed`),
        computed only for a forward that draws or may draw."""
        if self._draws.get(key) is False:
            return fn()
        generator, lock = _generator(self.device)
        with lock:
            saved = generator.get_state()
            generator.manual_seed(stage_seed(*seeds))
            seeded = generator.get_state() if key not in self._draws else None
            try:
                out = fn()
                if seeded is not None:
                    self._draws[key] = not torch.equal(seeded, generator.get_state())
            finally:
                generator.set_state(saved)
        return out


def _generator(device: torch.device) -> tuple[torch.Generator, threading.Lock]:
    """The default generator of `device` and the lock its users share."""
    if device.type != "cuda":
        return torch.default_generator, _CPU_RNG_LOCK
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _CPU_RNG_LOCK:
        lock = _CUDA_RNG_LOCKS.setdefault(index, threading.Lock())
    return torch.cuda.default_generators[index], lock
