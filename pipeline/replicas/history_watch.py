"""The launcher's reading of the record: a lost group healable, groups stuck, ends compared."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from pipeline.replicas.record import PARTIAL, group_key, hold_key, read_record

if TYPE_CHECKING:
    from pipeline.replicas.launch import ReplicaGroup

__all__ = ["HISTORY_GRACE_S", "Progress", "Stuck", "compare_ends", "history_lost", "holding"]

# After a group is lost, how long the live groups get to show (in the record) that one of
# them holds the job's history, before the job is declared unable to heal: a group writes
# its count just after its commit, and the lost one may have written first.
HISTORY_GRACE_S = 20.0


class Stuck:
    """Live groups that can never reach the job's history: every group holding it finished,
    so none is left in a quorum to heal them (they would retry their step forever)."""

    def __init__(self, record: Any, groups: list[ReplicaGroup], nproc: int = 1) -> None:
        self.record, self.groups, self.nproc = record, groups, nproc
        self.next_look = 0.0
        self.since: float | None = None

    def check(self) -> str | None:
        now = time.monotonic()
        if now < self.next_look:
            return None
        self.next_look = now + 0.5
        counts = {g: entry[0] for g, entry in read_record(self.record, len(self.groups),
                                                          self.nproc).items()}
        latest = max(counts.values(), default=0)
        live = [g for g in self.groups if not g.done]
        behind = [g.replica_id for g in live if counts.get(g.replica_id, 0) < latest]
        if not (behind and any(g.done for g in self.groups)
                and all(counts.get(g.replica_id, 0) < latest for g in live)):
            self.since = None
            return None
        self.since = now if self.since is None else self.since
        if now - self.since < HISTORY_GRACE_S:
            return None
        done = [g.replica_id for g in self.groups if g.done]
        return (f"replica group(s) {behind} never reached the job's history: the groups that "
                f"hold it ({done}) finished at {latest} committed steps, and no live group "
                f"holds it to heal them from (each group's count: {counts}); the finished "
                f"groups' weights are the job's result")


def history_lost(record: Any, groups: list[ReplicaGroup], lost: ReplicaGroup,
                  nproc: int = 1) -> str | None:
    """Why no group can heal `lost` (None if a live group holds the job's history: every
    one of its ranks holds the latest count). Up to HISTORY_GRACE_S is waited while a live
    group may be writing the last commit (every rank of it within a step of the latest);
    none when no live group can be (none live, or each holds a heal in part or is further
    behind): nothing would come of the wait."""
    deadline = time.monotonic() + HISTORY_GRACE_S
    while True:
        entries = read_record(record, len(groups), nproc)
        counts = {g: entry[0] for g, entry in entries.items()}
        latest = max(counts.values(), default=0)
        live = [g for g in groups if g is not lost and not g.done and g.failed_rank() is None]
        if latest == 0 or any(entries.get(g.replica_id, (0, 0))[0] == latest
                              and entries[g.replica_id][1] != PARTIAL for g in live):
            return None
        writing = [g for g in live if counts.get(g.replica_id, 0) >= latest - 1]
        if not writing or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    finished = [g.replica_id for g in groups if g.done]
    if finished:
        return (f"the job's other group(s) {finished} finished at {latest} committed steps "
                f"and no live group holds that history to heal it from (started again, it "
                f"would train from its initial weights alone): the finished groups' weights "
                f"are the job's result")
    partial = sorted(g for g, (_, lineage) in entries.items() if lineage == PARTIAL
                     and any(x.replica_id == g and x is not lost and not x.done for x in groups))
    half = (f"; group(s) {partial} hold a heal in part (their ranks at different steps), "
            f"which is undone, never trained on" if partial else "")
    return (f"no live group holds the job's history: its {latest} committed steps were held "
            f"by the groups lost (each group's count, the steps all its ranks hold: "
            f"{counts}){half}. None can be healed, and none is started again from its "
            f"initial weights in its place (that would be another history): the job ends; "
            f"resume the job from its last sharded checkpoint (pipe.save / pipe.load, "
            f"docs/checkpoints.md): start the job again with a script that loads it")


def holding(record: Any, replica: int, nproc: int) -> bool:
    """Whether every rank of group `replica` holds at the count it last wrote (hold.py: at the
    end of its loop, waiting for its peers, its own deadline bounding the wait)."""
    keys = [(hold_key(replica, r), group_key(replica, r)) for r in range(nproc)]
    return all(record.check([hold, entry]) and record.get(hold) == record.get(entry)
               for hold, entry in keys)


class Progress:
    """A live group whose committed count (all its ranks') has not moved for `timeout`
    seconds since it started or last moved: it will not commit again (retrying a step of
    another history, waiting for a heal none can give), and the job ends saying so. A group
    that holds at the end of its loop is not stuck: it waits for its peers to come back."""

    def __init__(self, record: Any, groups: list[ReplicaGroup], nproc: int,
                 timeout: float) -> None:
        self.record, self.groups, self.nproc, self.timeout = record, groups, nproc, timeout
        now = time.monotonic()
        self.seen = {g.replica_id: (0, now) for g in groups}  # group: (count, since when)
        self.next_look = 0.0

    def restarted(self, group: ReplicaGroup) -> None:
        self.seen[group.replica_id] = (0, time.monotonic())

    def check(self) -> str | None:
        now = time.monotonic()
        if now < self.next_look:
            return None
        self.next_look = now + 0.5
        entries = read_record(self.record, len(self.groups), self.nproc)
        latest = max((c for c, _ in entries.values()), default=0)
        for g in self.groups:
            count = entries.get(g.replica_id, (0, 0))[0]
            seen, since = self.seen[g.replica_id]
            if count != seen or g.done or holding(self.record, g.replica_id, self.nproc):
                self.seen[g.replica_id] = (count, now)
            elif now - since > self.timeout:
                return (f"replica group {g.replica_id} committed no step for {now - since:.0f}s "
                        f"(--progress-timeout {self.timeout:g}): it holds {count} committed "
                        f"steps, the job's history {latest}, and it will not commit again "
                        f"(its ranks' lines above say what it retries); resume the job from "
                        f"its last sharded checkpoint (pipe.save / pipe.load, "
                        f"docs/checkpoints.md) rather than retry forever")
        return None


def compare_ends(record: Any, groups: list[ReplicaGroup], nproc: int = 1) -> int:
    """0 if every group ended holding the same history (count and lineage), else 1."""
    ends = read_record(record, len(groups), nproc)
    if len(set(ends.values())) <= 1:
        return 0
    print(f"pipeline.launch: the replica groups ended with different histories (committed "
          f"steps, lineage): {ends}; their weights differ", file=sys.stderr)
    return 1
