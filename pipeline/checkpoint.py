"""Recomputation and RNG replay: a micro-batch's forward can run again, drawing the same randoms.

Every forward of stage s on micro-batch m runs under a generator seeded from (step seed, s, m),
so dropout masks depend on neither the schedule, nor the recompute mode, nor thread timing.
A checkpointed forward keeps only its inputs and is replayed under the same seed right before
its backward. The CPU generator is one per process, shared by every worker thread: stages that
draw from it run their forward under a lock (found out on their first forward), the others
run freely. CUDA stages use their own device's generator, touched by their thread alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

__all__ = ["CHECKPOINT_MODES", "RngReplay", "is_recomputing", "stage_seed"]

CHECKPOINT_MODES = ("never", "except_last", "always")
T = TypeVar("T")
_state = threading.local()
_CPU_RNG_LOCK = threading.Lock()


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


class RngReplay:
    """Runs a stage's forward under its (step, stage, micro-batch) seed on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # (stage, training mode) -> whether that forward draws from the CPU generator.
        self._uses_cpu_rng: dict[tuple[int, bool], bool] = {}

    def run(self, key: tuple[int, bool], seed: int, fn: Callable[[], T]) -> T:
        if self.device.type == "cuda":
            return self._run_cuda(seed, fn)
        if self._uses_cpu_rng.get(key) is False:
            return fn()
        with _CPU_RNG_LOCK:
            generator = torch.default_generator
            saved = generator.get_state()
            generator.manual_seed(seed)
            seeded = generator.get_state() if key not in self._uses_cpu_rng else None
            try:
                out = fn()
                if seeded is not None:
                    self._uses_cpu_rng[key] = not torch.equal(seeded, generator.get_state())
            finally:
                generator.set_state(saved)
        return out

    def _run_cuda(self, seed: int, fn: Callable[[], T]) -> T:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            return fn()
        finally:
            generator.set_state(saved)
