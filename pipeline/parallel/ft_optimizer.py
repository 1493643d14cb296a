"""The optimizer of a fault-tolerant Pipe: torchft's OptimizerWrapper, averaging over replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torchft.optim import OptimizerWrapper  # imported only when fault tolerance is on

if TYPE_CHECKING:
    from pipeline.parallel.fault_tolerance import FaultTolerance

__all__ = ["ReplicaOptimizer"]


class ReplicaOptimizer(OptimizerWrapper):  # type: ignore[misc]  # torchft ships no types
    """`step()` averages this rank's gradients over its stage's peers in the quorum, then
    steps the wrapped optimizer only if torchft's `should_commit` says every rank of every
    replica in the quorum finished the step without error."""

    def __init__(self, manager: Any, optim: torch.optim.Optimizer,
                 ft: FaultTolerance) -> None:
        super().__init__(manager, optim)
        self._ft = ft

    def zero_grad(self, set_to_none: bool = True) -> None:
        # torchft's wrapper starts the quorum here; a Pipe starts it at the top of pipe.step
        # instead, so the loop may call zero_grad before or after the step.
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise TypeError("a fault-tolerant optimizer takes no closure")
        params = [p for g in self.optim.param_groups for p in g["params"]]
        self._ft.average_gradients(params)
        self._ft.commit(self.optim.step)
