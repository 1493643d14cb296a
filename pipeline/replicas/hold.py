"""The end of a fault-tolerant loop: a group at `total` holds, training nothing, until every
replica group is back with it.

A group that reached `total` committed steps while another was lost used to train on, past
`total` (283 to 467 steps for a total of 40), until a step held every group. It now holds:
each round is a quorum (which heals a group that is behind, inside its start: the quorum is
synchronous), a small all-reduce of this group's one-hot and lineage over the quorum, and a
vote not to commit. The all-reduce keeps a heal's source in the round until the healing group,
which heals before it reaches the all-reduce, has read its state (the source serves it until
its vote, torchft's `disallow_checkpoint`). Every group in a quorum is at the quorum's highest
step once its heal is done, so every group of a hold round is at `total`: none trains a step
whose collectives its peers would not join. The loop ends in the round whose all-reduce held
every replica group with one lineage: all hold the same history at `total`, and all end in that
round (they read the same reduced buffer; the ranks of a group agree on it first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from pipeline.comm.handed import Handed
from pipeline.errors import PipelineError
from pipeline.replicas import lineage as ft_lineage

if TYPE_CHECKING:
    from pipeline.replicas.replica import FaultTolerance

__all__ = ["HOLD_PAUSE_S", "Holding", "hold_round", "training_steps"]

_log = logging.getLogger(__name__)

# Between two rounds of a group that holds without all its peers: a lone survivor asks the
# lighthouse for a quorum a few times a second, not as fast as it can (a restarting group
# beside it needs the CPUs), and a group that comes back waits at most this for it.
HOLD_PAUSE_S = 0.15


class Holding(PipelineError):
    """Why a hold round votes not to commit: it trained nothing (given to torchft's vote,
    never raised)."""


def training_steps(ft: FaultTolerance, total: int, deadline: float) -> Iterator[int]:
    """The step to train next, its quorum (and a heal) done first, while fewer than `total`
    steps are committed; then hold rounds until every replica group is present with one
    history (or a step committed with every group reached `total`); `deadline` seconds after
    reaching `total` without that, PipelineError."""
    reached: float | None = None
    while True:
        everyone = ft.last_committed and len(ft.participants) == ft.num_replicas
        if ft.committed_steps >= total and everyone:
            return
        # The quorum here, at the top of the loop: a heal lands after the loop body's own
        # updates of the last step (a scheduler's step) and before it picks the data.
        ft._quorum()
        step = ft.committed_steps
        if step < total:
            yield step
            continue
        if reached is None:
            reached = time.monotonic()
            if ft.record is not None and ft._writes_count:  # the launcher's watch: not stuck
                ft.record.holds(step, ft.lineage)
        present = hold_round(ft)
        if present is None:
            return
        waited = time.monotonic() - reached
        if waited > deadline:
            raise PipelineError(
                f"replica group {ft.replica_id} reached {total} committed steps and held there "
                f"(training none past them), but no round since held every replica group "
                f"(last: {present}) within {deadline:g}s (training_steps' deadline): a group "
                f"did not come back")
        if not ft.holding_said:
            ft.holding_said = True
            _log.warning("replica group %d holds at %d committed steps until every replica "
                         "group is back (replicas present: %s; deadline %gs)", ft.replica_id,
                         step, ", ".join(map(str, present)) or "none", deadline)
        time.sleep(HOLD_PAUSE_S)


def hold_round(ft: FaultTolerance) -> tuple[int, ...] | None:
    """One round of a group at its total, its quorum started: None when every replica group
    took part in it with this group's lineage, as every rank of this group saw it; else the
    replica groups this rank saw (none after an error)."""
    manager, n = ft.manager, ft.num_replicas
    here = torch.zeros(n, dtype=torch.float32)
    here[ft.replica_id] = 1.0
    # The one-hot and the lineage, laid out as in a step's average (average_gradients).
    flat = torch.cat([here, ft_lineage.encode(ft.lineage, ft.replica_id, n, here.dtype,
                                              here.device)])
    held = Handed([flat])
    manager.allreduce(flat).wait()
    present: tuple[int, ...] = ()
    if manager.errored() is None:
        held.settle()  # see average_gradients: not after an error
        ones = flat[:n]
        present = tuple(int(r) for r in ones.nonzero().flatten())
        ft._check_ids(ones)
        # Other lineages at one step: none ends, and each group apart from the
        # lowest-numbered one's stops, to restart and heal from it (as in a step).
        ft._check_lineages(ft_lineage.decode(flat[n:], present))
    whole = manager.errored() is None and len(present) == n
    manager.report_error(Holding(f"replica group {ft.replica_id} holds at "
                                 f"{ft.committed_steps} committed steps: nothing to commit"))
    try:
        if manager.should_commit():  # False (an error was reported): the source stops serving
            raise PipelineError(f"replica group {ft.replica_id}: a hold round was committed, "
                                f"which trained nothing; torchft's vote ignored the reason "
                                f"reported to it")
    finally:
        ft._quorum_started = False
    # A rank whose all-reduce failed (a peer lost in it) while its group's others saw every
    # group must not be left alone in the next quorum, which waits for all of them: the
    # group ends only if every one of its ranks saw everyone.
    return None if ft.agree(whole) else present
