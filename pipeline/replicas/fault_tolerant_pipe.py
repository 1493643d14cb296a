"""What a Pipe offers its training loop under fault tolerance: the loop, the counts, the ids."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from pipeline.errors import PipeConfigError

if TYPE_CHECKING:
    from pipeline.replicas.replica import FaultTolerance

__all__ = ["FaultTolerantPipe"]


class FaultTolerantPipe:
    """What a Pipe offers its training loop under fault tolerance (a base class of Pipe)."""

    _ft: FaultTolerance | None

    def _require_ft(self, what: str) -> FaultTolerance:
        if self._ft is None:
            raise PipeConfigError(f"pipe.{what} needs Pipe(..., fault_tolerance=True); this "
                                  f"Pipe was built without it")
        return self._ft

    def fault_tolerant(self, optimizer: torch.optim.Optimizer, *, scaler: Any = None,
                       state: Mapping[str, Any] | None = None) -> torch.optim.Optimizer:
        """`optimizer` (built on pipe.parameters()), applying a step only when torchft's
        quorum committed it: gradients are first averaged over the replicas present. With a
        GradScaler (also passed to pipe.step), `optimizer.step()` runs `scaler.step` and
        `scaler.update` after the average, and a heal carries the scaler's state. `state`:
        whatever else a step depends on, by name (`{"scheduler": lr_scheduler}`): a heal
        carries each one's `state_dict()` and loads it with `load_state_dict()`."""
        return self._require_ft("fault_tolerant(optimizer)").wrap(optimizer, scaler, state)

    def training_steps(self, total: int, *, deadline: float = 300.0) -> Iterator[int]:
        """The loop of a fault-tolerant job: yields the committed step to train (pick its
        batch by it), its quorum and any heal already done, until `total` steps are committed
        and the last committed step held every replica group; a group that does not come
        back within `deadline` seconds of reaching `total` raises PipelineError."""
        return self._require_ft("training_steps(total)").training_steps(total, deadline)

    @property
    def last_step_committed(self) -> bool:
        """Whether the last optimizer.step() committed its step (else it is taken again)."""
        return self._require_ft("last_step_committed").last_committed

    @property
    def committed_steps(self) -> int:
        """Steps committed by the quorum (a healed replica takes the count from its peer)."""
        return self._require_ft("committed_steps").committed_steps

    @property
    def num_participants(self) -> int:
        """Replica groups in the last quorum (0 before the first step): the step's gradients
        were averaged over this many."""
        return self._require_ft("num_participants").num_participants

    @property
    def participants(self) -> tuple[int, ...]:
        """The replica ids whose gradients the last step's average held (read off the
        average itself); a step that was then not committed says so in committed_steps."""
        return self._require_ft("participants").participants

    @property
    def replica_id(self) -> int:
        """This replica group's index (0 without fault tolerance), to pick its data."""
        return self._ft.replica_id if self._ft is not None else 0

    @property
    def num_replicas(self) -> int:
        """The number of replica groups of the job (1 without fault tolerance)."""
        return self._ft.num_replicas if self._ft is not None else 1
