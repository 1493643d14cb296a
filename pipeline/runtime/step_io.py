"""What one training step gives every rank, and what its ranks produce."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.runtime.context import CallerState
from pipeline.runtime.syncs import StepSyncs
from pipeline.runtime.versions import WeightVersions

__all__ = ["LossFn", "StepInputs", "StepResult"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class StepInputs:
    """What one step gives every rank; nobody writes to it."""

    inputs: Sequence[tuple[Any, ...]]  # micro-batches for the first stage
    targets: Sequence[Any] | None  # per micro-batch, for the loss on the last stage
    loss_fn: LossFn | None  # None: forward only
    loss_weights: Sequence[float]  # micro-batch share of the batch's mean (pipeline/weighting)
    checkpointed: Sequence[bool]  # per micro-batch
    seed: int
    versions: WeightVersions | None = None  # versioned (2BW) schedules
    track_memory: bool = False
    caller: CallerState = field(default_factory=CallerState)  # autocast, inference mode
    scaler: Any = None  # a torch.amp.GradScaler: each micro-batch's loss is scaled for backward
    syncs: StepSyncs | None = None  # what a program's sync actions call (runtime/syncs.py)
    t0: float = field(default_factory=time.perf_counter)
    # Per micro-batch, the rows of its input and of its target as the batch's cut counted
    # them (runtime/batches.py); None: counted at the action
    rows: Sequence[int | None] | None = None
    target_rows: Sequence[int | None] | None = None
    # The profiled step of schedule="auto": reads the calling thread's nanoseconds waited on a
    # CPU's run queue so far (pipeline/schedstat.py), around each compute action; None: unread
    thread_wait: Callable[[], int | None] | None = None


@dataclass
class StepResult:
    """What the ranks of one step produce: losses and outputs of the last stage, per micro-batch."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # weighted: they add up
    # Each micro-batch's own loss as loss_fn returned it (`pipe.step(losses=...)`, torch's
    # `losses=`); NaN where nothing was counted and loss_fn did not run (runtime/weighting.py).
    own_losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    # First stage: the gradient of each micro-batch's input entries (None where none is needed).
    input_grads: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


