"""A heal as one transaction per replica group: applied by every rank, checked, or undone."""

from __future__ import annotations

from typing import Any

from pipeline.errors import PipelineError

__all__ = ["HealIncomplete", "check_heal"]


class HealIncomplete(PipelineError):
    """A rank's heal failed or brought another state than the job's history holds: its group
    is half healed (its ranks hold different steps) and must restart as lost."""


def check_heal(ft: Any, step: int) -> None:
    """After a quorum in which rank `ft.rank` of replica group `ft.replica_id` healed to
    `step` committed steps: raise HealIncomplete unless the heal was applied and the state
    received is the history's at that step (its digest, ft_lineage.state_digest, equals the
    one the job's record holds for this rank at `step`).

    torchft heals each rank of a group on its own, from its own source: a source lost
    between two of them left rank 0 at the peers' step and rank 1 at step 0, and the group
    (reporting whichever rank asked last) trained on as one replica from a mix of states, or
    from the initial weights over the history. Raised, this ends the rank; its launcher
    ends the group and restarts it as lost (its ranks' records are cleared), or ends the job
    when no live group holds the history: the heal is undone, never kept in part."""
    where = f"replica group {ft.replica_id} rank {ft.rank}"
    error = ft.manager.errored()
    if error is not None:
        raise HealIncomplete(
            f"{where}: its heal to step {step} failed ({type(error).__name__}: {error}); its "
            f"other ranks may have healed: a group whose ranks hold different steps is not "
            f"one replica, so it stops and restarts as lost (healed again whole, from a live "
            f"group that holds the job's history, if one does)")
    digest = ft._digest_now()
    held = ft.record.digest_at(step) if ft.record is not None else None
    if held is not None and held != digest:
        raise HealIncomplete(
            f"{where}: the state its heal brought (digest {digest}) is not the job's state "
            f"after {step} committed steps (digest {held}, as the record holds it): its "
            f"source held other weights under that step; the group stops and restarts as "
            f"lost")
