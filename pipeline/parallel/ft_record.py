"""The job's record of committed steps, kept by the launcher: one history per job.

torchft commits a step for every group of a quorum, and a quorum forms from the groups whose
heartbeats the lighthouse sees. On a loaded host a live group's heartbeats can stall past the
timeout, and two groups may then each form quorums alone and commit the same step numbers
from other weights: two histories, which no heal reconciles (torchft heals only a group that
is behind). The record makes history a fact kept outside every group: the first quorum to
commit step s writes which history it extends (the lineage after s) under `commit/<s>`, with
compare-and-set, in a store the launcher serves; a group whose own lineage after s differs
does not hold the job's history, and commits nothing until a quorum with a group that does
heals it. Each group also writes how many steps it has committed (`group/<id>`), so that the
launcher can tell, when a group is lost, whether a live group still holds the history.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from pipeline.errors import PipelineError

__all__ = ["RECORD_ENV", "JobRecord", "NotLatest", "group_key", "read_record"]

RECORD_ENV = "PIPELINE_FT_RECORD"  # the record's port on 127.0.0.1, set by the launcher


class NotLatest(PipelineError):
    """This group does not hold the job's latest history: it must heal before committing."""


def group_key(replica: int) -> str:
    return f"group/{replica}"


def read_record(store: Any, replicas: int) -> dict[int, tuple[int, int]]:
    """Each group's (committed steps, lineage) as last written; groups that never wrote
    are left out."""
    out = {}
    for g in range(replicas):
        key = group_key(g)
        if store.check([key]):
            count, lineage = store.get(key).split()
            out[g] = (int(count), int(lineage))
    return out


class JobRecord:
    """A rank's view of the record (None where no launcher keeps one: torchrun by hand)."""

    def __init__(self, store: Any, replica: int) -> None:
        self.store, self.replica = store, replica

    @classmethod
    def from_environment(cls, replica: int, timeout: float) -> JobRecord | None:
        port = os.environ.get(RECORD_ENV)
        if not port:
            return None
        from torch._C._distributed_c10d import TCPStore

        store = TCPStore("127.0.0.1", int(port), None, False, timedelta(seconds=timeout))
        return cls(store, replica)

    def conflict(self, step: int, lineage_after: int) -> int | None:
        """The lineage another history committed step `step` with, if it is not ours."""
        key = f"commit/{step}"
        if not self.store.check([key]):
            return None
        theirs = int(self.store.get(key))
        return None if theirs == lineage_after else theirs

    def claim(self, step: int, lineage_after: int) -> int | None:
        """Record that step `step` extends the history to `lineage_after`, unless another
        history recorded it first (then its lineage is returned)."""
        got = int(self.store.compare_set(f"commit/{step}", "", str(lineage_after)))
        return None if got == lineage_after else got

    def committed(self, steps: int, lineage: int) -> None:
        """This group now holds `steps` committed steps of history `lineage` (written by its
        rank 0)."""
        self.store.set(group_key(self.replica), f"{steps} {lineage}")
