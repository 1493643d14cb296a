"""A Pipe's state as users save and load it: sharded checkpoints, state dicts, resumable state."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.state import model_state

__all__ = ["PipeState"]


class PipeState:
    """Pipe's saving and loading (a mixin of Pipe, before nn.Module: `super()` is the
    Module's). Every method works in one process and multi-process alike."""

    def save(self, path: Any, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Save a sharded checkpoint (torch.distributed.checkpoint): every rank writes its own
        layers and optimizer state; `load` reads it under any balance, rank count or device.
        `path` holds the old checkpoint or the new one, complete, whenever a rank dies."""
        from pipeline.state import sharded  # torch.distributed.checkpoint is slow to import

        sharded.save(self, path, optimizer)  # type: ignore[arg-type]  # a Pipe
        ft = getattr(self, "_ft", None)
        if ft is not None:  # a replica job that ends names its last save
            ft.saved(str(path))

    def load(self, path: Any, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load what `save` wrote (from any balance, rank count, or a plain model)."""
        from pipeline.state import sharded

        sharded.load(self, path, optimizer)  # type: ignore[arg-type]  # a Pipe

    def full_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, with the model's keys, for a single-device model.

        In one process this is `state_dict()`. Multi-process, every rank must call it; rank
        `dst` gets the full dictionary (on CPU) and the others None (on a mesh: rank `dst` of
        the pipeline of dp rank 0).
        """
        return model_state.full_state_dict(self, dst)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load with the model's keys. Multi-process, pass the full model's state_dict: each
        rank takes its own layers' entries (strictness applies to those)."""
        module: Any = super()
        mine = model_state.loadable(self, state_dict, strict, list(
            nn.Module.named_parameters(self, remove_duplicate=False)))  # type: ignore[arg-type]
        return module.load_state_dict(mine, strict=strict, assign=assign)

    def training_state(self) -> dict[str, Any]:
        """Everything this rank needs to resume training bit-identically, beside the optimizer's
        own `state_dict()`: the parameters and buffers (the model's keys), PipeDream-2BW's
        previous weights, and the random state the next step's seed is drawn from (torch's
        global generators). Multi-process, each rank saves and loads its own."""
        return model_state.training_state(self)

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore what `training_state()` saved (then load the optimizer's state yourself)."""
        model_state.load_training_state(self, state)
