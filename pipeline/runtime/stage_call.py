"""A stage's forward as a compute action calls it: its layers, wrapped only in what they need.

Every forward could run under the caller's autocast, the micro-batch scope (deferred
BatchNorm's hooks read it), the RNG replay (a seed per stage and micro-batch) and the buffer
guard. On a latency-bound model each of those wrappers costs about as much as a small layer, so
what a stage needs is decided once per step (its layers' modes and whether it holds a BatchNorm
layer) or learned on its first forward of a mode (whether it draws randoms, which buffers it
changes). Once both are known, a forward (not a replay) that draws nothing is the bare call of
the stage: the buffer guard does nothing on such a forward (it acts on replays), and the RNG
replay has nothing to seed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipeline.runtime.batchnorm import microbatch_scope
from pipeline.runtime.microbatch import as_tuple, from_tuple, like
from pipeline.runtime.recompute import BufferGuard, RngReplay, mode_key
from pipeline.runtime.step_io import StepInputs
from pipeline.runtime.versions import call_with
from schedules import Action

__all__ = ["StageCall", "first_layer"]

_Key = tuple[int, tuple[bool, ...]]  # recompute.mode_key's


class StageCall:
    """Runs the forwards of one rank's stages (and their replays before a backward)."""

    def __init__(self, stages: dict[int, nn.Module], device: torch.device) -> None:
        self.stages = stages
        # A stage whose first layer works in place gets a copy of its inputs: the received
        # inputs are leaves that require grad (autograd forbids changing them in place) and a
        # checkpointed micro-batch replays its forward from them.
        self._copy_inputs = {s: getattr(first_layer(m), "inplace", False) is True
                             for s, m in stages.items()}
        self.rng = RngReplay(device)
        self.buffers = BufferGuard()
        # Whether a stage holds a BatchNorm layer, the only reader of the micro-batch scope
        # (deferred BatchNorm's hooks, put on when the Pipe is built, as the stages' layers).
        self._scoped = {s: any(isinstance(m, _BatchNorm) for m in module.modules())
                        for s, module in stages.items()}
        # Per stage, its layers' training flags (recompute.mode_key): read once per step (they
        # cannot change within one), not once per forward (a walk of every submodule).
        self._modes: dict[int, _Key] = {}

    def begin(self) -> None:
        """Read the stages' modes for the step about to run."""
        for s, module in self.stages.items():
            self._modes[s] = mode_key(s, module)

    def __call__(self, action: Action, inputs: tuple[Any, ...], step: StepInputs, *,
                 replay: bool = False) -> tuple[Any, ...]:
        s = action.stage
        module = self.stages[s]
        if self._copy_inputs[s]:
            inputs = like(inputs, (v.clone() if isinstance(v, torch.Tensor)
                                   and v.is_floating_point() else v for v in inputs))
        # As in nn.Sequential, a layer gets the previous output as one argument (a tuple stays
        # a tuple, a 1-tuple too): transported tuples are unpacked for transport only.
        arg = from_tuple(inputs)
        fn: Callable[[], Any]
        if action.version is None:
            def fn() -> Any:
                return module(arg)
        else:
            assert step.versions is not None, f"{action} needs weight versions"
            weights = step.versions.weights(s, action.version)

            def fn() -> Any:
                return call_with(module, weights, arg)
        key = self._modes[s]
        scoped, autocast = self._scoped[s], bool(step.caller.autocast)
        try:
            if not (scoped or autocast):
                return as_tuple(self._guarded(key, module, fn, step.seed, action, replay))
            with ExitStack() as contexts:
                if autocast:
                    contexts.enter_context(step.caller.forward())
                if scoped:
                    contexts.enter_context(microbatch_scope(action.microbatch))
                return as_tuple(self._guarded(key, module, fn, step.seed, action, replay))
        except RuntimeError as exc:
            if "in-place operation" not in str(exc) or "leaf Variable" not in str(exc):
                raise
            first = first_layer(module)
            raise RuntimeError(
                f"stage {s} starts with {type(first).__name__}, which changes its input in "
                f"place; a stage's input is a leaf that requires grad, which autograd forbids "
                f"changing in place. Give the layer an `inplace = True` attribute (Pipe then "
                f"copies the input first, as for nn.ReLU(inplace=True)), make it out of place, "
                f"or move the stage boundary: {exc}") from exc

    def _guarded(self, key: _Key, module: nn.Module, fn: Callable[[], Any], seed: int,
                 action: Action, replay: bool) -> Any:
        if not replay and self.buffers.known(key) and self.rng.quiet(key):
            return fn()  # what the guard and the replay would come down to, without them
        seeds = (seed, action.stage, action.microbatch)
        guard = self.buffers.replay if replay else self.buffers.forward
        return guard(key, module, lambda: self.rng.run(key, seeds, fn))


def first_layer(stage: nn.Module) -> nn.Module:
    """The layer that receives a stage's input (the stage itself if it is not a Sequential)."""
    return stage[0] if isinstance(stage, nn.Sequential) and len(stage) else stage
