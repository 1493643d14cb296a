"""The optimizer of a fault-tolerant Pipe: torchft's OptimizerWrapper, averaging over replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState
from torchft.optim import OptimizerWrapper  # imported only when fault tolerance is on

from pipeline.errors import PipeConfigError

if TYPE_CHECKING:
    from pipeline.replicas.replica import FaultTolerance

__all__ = ["ReplicaOptimizer"]


class ReplicaOptimizer(OptimizerWrapper):  # type: ignore[misc]  # torchft ships no types
    """`step()` averages this rank's gradients over its stage's peers in the quorum, then
    steps the wrapped optimizer only if torchft's `should_commit` says every rank of every
    replica in the quorum finished the step without error.

    With a GradScaler, `step()` also runs `scaler.step` and `scaler.update`, after the
    average: a non-finite gradient on any replica is then non-finite in every replica's
    average, so every replica skips the same steps and keeps the same scale (were each to
    decide alone, one would skip the average its peers wait in)."""

    def __init__(self, manager: Any, optim: torch.optim.Optimizer, ft: FaultTolerance,
                 scaler: Any = None) -> None:
        super().__init__(manager, optim)
        self._ft = ft
        self._scaler = scaler

    def zero_grad(self, set_to_none: bool = True) -> None:
        # torchft's wrapper starts the quorum here; a Pipe starts it at the top of pipe.step
        # instead, so the loop may call zero_grad before or after the step.
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise TypeError("a fault-tolerant optimizer takes no closure")
        scaler = self._scaler
        if scaler is not None and scaler._per_optimizer_states[id(self)]["stage"] \
                is not OptState.READY:
            # scaler.step(optimizer) unscaled the gradients before the average, and will
            # unscale them again here: the average and the skip must come first.
            raise PipeConfigError(
                "with pipe.fault_tolerant(optimizer, scaler=scaler), call optimizer.step() "
                "alone: it runs scaler.step and scaler.update itself, after the cross-replica "
                "average; drop scaler.step(optimizer), scaler.unscale_(optimizer) and "
                "scaler.update()")
        params = [p for g in self.optim.param_groups for p in g["params"]]
        self._ft.average_gradients(params)
        if scaler is None:
            self._ft.commit(self.optim.step)
            return

        def scaled_step() -> None:
            scaler.step(self.optim)  # skips the step when the average is not finite
            scaler.update()

        self._ft.commit(scaled_step)
