"""The stage runtime's handlers for a program's syncs: tied weights, dp reductions, the scaler.

Each sync action of the program (schedules/program.py) is one call here, made by the rank the
program puts it on, where the program puts it: the runtime never decides when to synchronise.
Tied weights travel as messages of the schedule, `("T", copy, owner)` and `("G", owner, copy)`,
through the same transport and in the same per-pair order as activations, so they cannot
overtake or be overtaken by them; a link between stages of one rank moves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from schedules import Action, Op

if TYPE_CHECKING:
    from pipeline.runtime.stage import StageRuntime, StepInputs, StepResult

__all__ = ["StepSyncs", "TieOps", "handlers"]


class TieOps(Protocol):
    """What tie actions do to the tied weights of a link (owner stage, copy stage): all the
    weights the two share, in the ties' order (pipeline/parallel/ties.py)."""

    def values(self, owner: int, copy: int) -> tuple[torch.Tensor, ...]: ...

    def set_values(self, copy: int, owner: int, values: Sequence[Any]) -> None: ...

    def take_grads(self, copy: int, owner: int) -> tuple[torch.Tensor | None, ...]: ...

    def add_grads(self, owner: int, copy: int, grads: Sequence[Any]) -> None: ...


@dataclass(frozen=True)
class StepSyncs:
    """What a step's sync actions call; None where the step has nothing of the kind.

    `reduce(stage)` launches the dp all-reduce of a stage's gradients (REDUCE_GRAD), `wait()`
    waits for the rank's reductions (AWAIT_GRAD), `overflow()` agrees on the scaler's
    overflow with every rank (OVERFLOW).
    """

    ties: TieOps | None = None
    reduce: Callable[[int], None] | None = None
    wait: Callable[[], None] | None = None
    overflow: Callable[[], None] | None = None


Handler = Callable[[Action, "StepInputs", "StepResult"], None]


def handlers(rt: StageRuntime) -> dict[Op, Handler]:
    """The sync handlers of runtime `rt`, by op (a tie's RECV is the runtime's own: a post)."""

    def syncs(step: StepInputs) -> StepSyncs:
        assert step.syncs is not None, "a program's syncs need StepInputs.syncs"
        return step.syncs

    def ties(step: StepInputs) -> TieOps:
        found = syncs(step).ties
        assert found is not None, "tie actions need StepSyncs.ties"
        return found

    def send_values(action: Action, step: StepInputs, result: StepResult) -> None:
        owner, copy = action.stage, action.microbatch
        rt.transport.send(("T", copy, owner), ties(step).values(owner, copy), rt.rank_of(copy))

    def send_grads(action: Action, step: StepInputs, result: StepResult) -> None:
        copy, owner = action.stage, action.microbatch
        rt.transport.send(("G", owner, copy), ties(step).take_grads(copy, owner),
                          rt.rank_of(owner))

    def take(kind: str, stage: int, peer: int) -> tuple[Any, ...] | None:
        """A tie message from another rank (None: the peer stage is on this rank)."""
        src = rt.rank_of(peer)
        if src == rt.rank:
            return None
        return rt.wait_for((kind, stage, peer), src)

    def tie_set(action: Action, step: StepInputs, result: StepResult) -> None:
        copy, owner = action.stage, action.microbatch
        got = take("T", copy, owner)
        ops = ties(step)
        ops.set_values(copy, owner, ops.values(owner, copy) if got is None else got)

    def tie_add(action: Action, step: StepInputs, result: StepResult) -> None:
        owner, copy = action.stage, action.microbatch
        got = take("G", owner, copy)
        ops = ties(step)
        ops.add_grads(owner, copy, ops.take_grads(copy, owner) if got is None else got)

    def reduce(action: Action, step: StepInputs, result: StepResult) -> None:
        launch = syncs(step).reduce
        if launch is not None:  # None: FSDP2 reduced in the backward's hooks
            launch(action.stage)

    def wait(action: Action, step: StepInputs, result: StepResult) -> None:
        done = syncs(step).wait
        if done is not None:
            done()

    def overflow(action: Action, step: StepInputs, result: StepResult) -> None:
        agree = syncs(step).overflow
        if agree is not None:
            agree()

    return {Op.SEND_T: send_values, Op.TIE_SET: tie_set, Op.SEND_G: send_grads,
            Op.TIE_ADD: tie_add, Op.REDUCE_GRAD: reduce, Op.AWAIT_GRAD: wait,
            Op.OVERFLOW: overflow}
