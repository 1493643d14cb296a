"""PipeDream-2BW weight versions: opened when a step starts, advanced by U, carried over."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["WeightVersions", "call_with"]

Weights = dict[str, torch.Tensor]


def _copy(named: Iterable[tuple[str, torch.Tensor]]) -> Weights:
    return {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in named}


def call_with(module: nn.Module, weights: Weights, arg: Any) -> Any:
    """`module(arg)` computed with `weights` (keyed as `module.named_parameters()` names them) in
    place of its parameters.

    The swap is by parameter identity, in every module that holds the parameter, so a module
    used twice in a stage (tied weights) sees the version under both uses; `functional_call`
    would leave the second use on the live parameter and leak gradient into it.
    """
    by_id = {id(p): weights[name] for name, p in module.named_parameters()}
    swapped: list[tuple[nn.Module, str, Any]] = []
    try:
        for mod in module.modules():
            for key, p in mod._parameters.items():
                if p is not None and id(p) in by_id:
                    swapped.append((mod, key, p))
                    # A plain tensor where a Parameter stood: what functional_call does too.
                    mod._parameters[key] = by_id[id(p)]  # type: ignore[assignment]
        return module(arg)
    finally:
        for mod, key, p in reversed(swapped):
            mod._parameters[key] = p


class WeightVersions:
    """The one owner of a pipeline's weight versions (per stage, numbered as the schedule does).

    A versioned schedule over n batches computes batch b with version b. When a step opens,
    version 0 is the previous step's weights (the current ones on the first step) and version 1
    a copy of the current ones; update U(s, b) turns batch b's gradients into the live
    parameters (version b + 1), lets the optimizer make version b + 2, and drops version b.
    When the step closes, version n is kept as the next step's version 0.
    """

    def __init__(self, partitions: dict[int, nn.Module]) -> None:
        self._modules = partitions
        self._live: dict[tuple[int, int], Weights] = {}
        self._previous: dict[int, Weights] = {}
        self._num_batches = 0
        self._optimizer: Any = None
        self._unopened: set[int] = set()  # stages whose versions this step has not taken
        self._lock = threading.Lock()  # one optimizer serves every stage of this process

    def open(self, num_batches: int, optimizer: Any = None) -> None:
        """Start a step. Each stage's versions 0 and 1 are taken at its first use: after the
        program's refresh of its tied weights (a copy takes its owner's value first)."""
        self._num_batches = num_batches
        self._optimizer = optimizer
        self._live.clear()
        self._unopened = set(self._modules)

    def _open(self, s: int) -> None:
        current = _copy(self._modules[s].named_parameters())
        previous = self._previous.get(s)
        self._live[(s, 0)] = previous if previous is not None else _copy(current.items())
        self._live[(s, 1)] = current
        for t in self._live[(s, 0)].values():
            t.grad = None
        self._unopened.discard(s)

    def weights(self, stage: int, version: int) -> Weights:
        if stage in self._unopened:  # one rank's thread runs each stage: no race on a stage
            with self._lock:
                self._open(stage)
        return self._live[(stage, version)]

    def update(self, stage: int, batch: int) -> None:
        """U(stage, batch): batch's gradients (at version `batch`) reach the live parameters;
        the optimizer, if the step owns one, steps them into version batch + 2."""
        module = self._modules[stage]
        used = self._live[(stage, batch)]
        with self._lock:
            for name, p in module.named_parameters():
                g = used[name].grad
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.to(p.device)
                else:
                    p.grad.add_(g)
            if self._optimizer is not None:
                self._optimizer.step()
                for p in module.parameters():
                    p.grad = None
            if batch + 2 <= self._num_batches:
                self._live[(stage, batch + 2)] = _copy(module.named_parameters())
            del self._live[(stage, batch)]

    def close(self) -> None:
        """The step ran: keep version n (the weights batch n would use) as the next step's
        version 0, and drop the rest."""
        n = self._num_batches
        self._previous = {s: self._live[(s, n)] for s in self._modules if (s, n) in self._live}
        self._live.clear()
        self._unopened.clear()
        self._optimizer = None

    def abandon(self) -> None:
        """The step failed: forget its versions, keep the previous step's."""
        self._live.clear()
        self._unopened.clear()
        self._optimizer = None

    @property
    def previous(self) -> dict[int, Weights]:
        """Per stage, the weights the next step computes its first batch with (empty before
        the first step)."""
        return self._previous

    def load_previous(self, previous: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restore `previous` (from a saved training state) onto the stages' devices."""
        unknown = sorted(set(previous) - set(self._modules))
        if unknown:
            raise ValueError(f"the saved weight versions are for stages {unknown}, which this "
                             f"pipeline (stages {sorted(self._modules)}) does not hold")
        restored: dict[int, Weights] = {}
        for s, weights in previous.items():
            live = dict(self._modules[s].named_parameters())
            if set(weights) != set(live):
                raise ValueError(f"the saved weight versions of stage {s} have keys "
                                 f"{sorted(weights)}, the stage has {sorted(live)}")
            restored[s] = _copy((name, t.to(live[name].device)) for name, t in weights.items())
        self._previous = restored
