"""The job's record of committed steps, kept by the launcher: one history per job.

torchft commits a step for every group of a quorum, and a quorum forms from the groups whose
heartbeats the lighthouse sees. On a loaded host a live group's heartbeats can stall past the
timeout, and two groups may then each form quorums alone and commit the same step numbers
from other weights: two histories, which no heal reconciles (torchft heals only a group that
is behind). The record makes history a fact kept outside every group: the first quorum to
commit step s writes which history it extends (the lineage after s) under `commit/<s>`, with
compare-and-set, in a store the launcher serves; a group whose own lineage after s differs
does not hold the job's history, and commits nothing until a quorum with a group that does
heals it. Each rank also writes how many steps it has committed, and the lineage it holds
(`group/<id>/<rank>`): a group holds the history only once every one of its ranks does (a heal
is one transaction per group: a group whose ranks were healed to different steps, or in part,
holds nothing), so that the launcher can tell, when a group is lost, whether a live group still
holds the history. Lineages are per rank (each carries a digest of its rank's stage state,
lineage), and so are the claims (`commit/<rank>/<s>`), and each rank's state digest once it
committed s steps (`digest/<rank>/<s>`), which a rank healed to s steps checks what it
received against.

The record also holds what every group must agree on and what the lighthouse cannot see. The
job's count of groups (`replicas`): the first to join (the launcher) writes it, and a group
started with another NUM_REPLICA_GROUPS is refused at join. Every rank's liveness (`beat/<pid>`):
torchft heartbeats the lighthouse from group rank 0 alone, so a stalled rank 1 held every
replica until the Pipe's timeout; each rank beats here from a daemon thread, which a stall of
the process (SIGSTOP, a freeze) stops too, and the launcher ends a group whose rank has not
beaten for its timeout, not counting the time the rank waited for a CPU (`Liveness`: a rank
held off the CPU by a loaded host is slow, not stalled). A beat tied to progress would not do:
a live rank waits in a quorum for up to a minute for a group that is starting.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from pipeline.errors import PipeConfigError, PipelineError
from pipeline.replicas.beats import EXITING, beat_key, start_beating
from pipeline.replicas.environment import NUM_REPLICAS_ENV as _NUM_REPLICAS_ENV
from pipeline.replicas.run_queue import PROC, RunQueue, Window, stderr_note

__all__ = ["PARTIAL", "RECORD_ENV", "REPLICAS_KEY", "STARVED_LIMIT_S", "JobRecord", "Liveness",
           "NotLatest", "Stall", "connect", "group_key", "hold_key", "read_record", "serve"]

RECORD_ENV = "PIPELINE_FT_RECORD"  # the record's port, on the lighthouse's host
REPLICAS_KEY = "replicas"  # the job's count of replica groups
# A group's lineage in read_record while its ranks disagree (a heal in part, a commit that
# not every rank has written yet): it holds no history.
PARTIAL = -1
# The most run-queue wait taken off a rank's silence: a rank that ran nothing for longer than
# this past the timeout (a host loaded beyond use) is ended as stalled. Below the progress
# timeout (600 s by default), which would end the whole job instead of restarting one group.
STARVED_LIMIT_S = 60.0
# A rank's threads are read once it has been silent for this share of the timeout (it beats
# ten times a timeout: a live rank is read rarely); waits before then are not taken off.
_READ_AFTER = 0.25


class Stall(NamedTuple):
    """A rank the watch takes for stalled: its pid, how long it went without a beat, and how
    much of that it waited for a CPU (taken off its silence before it was judged)."""

    pid: int
    silent: float
    starved: float


class NotLatest(PipelineError):
    """This group does not hold the job's latest history: it must heal before committing."""


def group_key(replica: int, rank: int = 0) -> str:
    return f"group/{replica}/{rank}"


def hold_key(replica: int, rank: int = 0) -> str:
    """Where a rank writes the count and lineage it holds at (its group's entry while it holds)."""
    return f"hold/{replica}/{rank}"


def read_record(store: Any, replicas: int, ranks: int = 1) -> dict[int, tuple[int, int]]:
    """Each group's (committed steps, lineage) as its `ranks` ranks last wrote them: the
    steps every rank holds (the fewest) and, where all agree, one lineage for them all (else
    PARTIAL); groups none of whose ranks wrote are left out."""
    out = {}
    for g in range(replicas):
        entries = []
        for r in range(ranks):
            key = group_key(g, r)
            if store.check([key]):
                count, lineage = store.get(key).split()
                entries.append((int(count), int(lineage)))
        if not entries:
            continue
        if len(entries) < ranks or len({c for c, _ in entries}) > 1:
            out[g] = (min(c for c, _ in entries), PARTIAL)
        else:
            lineages = [v for _, v in entries]
            out[g] = (entries[0][0], lineages[0] if ranks == 1
                      else zlib.crc32(repr(lineages).encode()))
    return out


class JobRecord:
    """A rank's view of the record (None where none is kept: torchrun by hand, unless the
    record is started alone, `python -m pipeline.replica_launch --record`)."""

    def __init__(self, store: Any, replica: int, rank: int = 0) -> None:
        self.store, self.replica, self.rank = store, replica, rank

    @classmethod
    def from_environment(cls, replica: int, timeout: float, rank: int = 0,
                         last_state: Any = None) -> JobRecord | None:
        """`last_state`: a callable naming where this rank's last committed state is, for
        the message of a rank that finds the launcher gone."""
        port = os.environ.get(RECORD_ENV)
        if not port:
            return None
        store = connect(int(port), timeout)
        _check_count(store, replica)
        start_beating(int(port), timeout, f"replica group {replica}", rank, last_state)
        return cls(store, replica, rank)

    def conflict(self, step: int, lineage_after: int) -> int | None:
        """The lineage another history committed step `step` with, if it is not ours."""
        key = f"commit/{self.rank}/{step}"
        if not self.store.check([key]):
            return None
        theirs = int(self.store.get(key))
        return None if theirs == lineage_after else theirs

    def claim(self, step: int, lineage_after: int) -> int | None:
        """Record that step `step` extends the history to `lineage_after`, unless another
        history recorded it first (then its lineage is returned)."""
        got = int(self.store.compare_set(f"commit/{self.rank}/{step}", "", str(lineage_after)))
        return None if got == lineage_after else got

    def committed(self, steps: int, lineage: int) -> None:
        """This rank now holds `steps` committed steps of history `lineage` (its group holds
        them once every rank wrote the same count)."""
        self.store.set(group_key(self.replica, self.rank), f"{steps} {lineage}")

    def holds(self, steps: int, lineage: int) -> None:
        """This rank holds at `steps` (hold.py): its count stays until its peers are back."""
        self.store.set(hold_key(self.replica, self.rank), f"{steps} {lineage}")

    def digest(self, steps: int, digest: int) -> int:
        """Record that this rank's state after `steps` committed steps has `digest`, unless
        one was recorded first; the digest the record holds."""
        return int(self.store.compare_set(f"digest/{self.rank}/{steps}", "", str(digest)))

    def digest_at(self, steps: int) -> int | None:
        """The digest of this rank's state after `steps` committed steps in the job's
        history, if one was recorded."""
        key = f"digest/{self.rank}/{steps}"
        return int(self.store.get(key)) if self.store.check([key]) else None


def connect(port: int, timeout: float) -> Any:
    """A client of the record kept by the job's coordinator at `port` on the lighthouse's host
    (coordinator: the same server, under the job's TLS)."""
    from pipeline.replicas.coordinator import StoreClient, lighthouse_hostport

    host = (lighthouse_hostport()[0] if os.environ.get("TORCHFT_LIGHTHOUSE")
            else "127.0.0.1")
    return StoreClient(host, port, timeout)


def _check_count(store: Any, replica: int) -> None:
    """Refuse a group that joins with another count of groups than the job's (the first to
    join, the launcher where there is one, sets it): its averages would not fit its peers'."""
    count = os.environ.get(_NUM_REPLICAS_ENV, "")
    if not count:
        return
    held = store.compare_set(REPLICAS_KEY, "", count).decode()
    if held != count:
        raise PipeConfigError(
            f"{_NUM_REPLICAS_ENV}={count} in replica group {replica}, but the job's record "
            f"holds {held} (set by the launcher, or by the first group to join): every group "
            f"of one job needs the same {_NUM_REPLICAS_ENV}; start them all with {held} (or "
            f"all with {count})")


class Liveness:
    """The launcher's watch on the ranks' beats: a rank whose count has not moved for
    `timeout` seconds while the watch looked, not counting the time it waited for a CPU, is
    stalled (a rank not yet beating, or exiting, is not watched).

    A rank held off the CPU by a loaded host is runnable, a stopped one is not: the run-queue
    wait its threads added while it was silent (the most of any one thread, from a quarter of
    the timeout on: run_queue.Window) is taken off its silence, up to STARVED_LIMIT_S. A
    SIGSTOPped rank waits on no run queue and is seen at the timeout. Ranks with no entry
    under `proc` (not started on this host), or where the kernel keeps no waits, are judged
    by the plain timeout.
    `proc`, `note` and `clock`: run_queue.RunQueue's, and the watch's time (for tests)."""

    def __init__(self, store: Any, timeout: float, *, proc: str | os.PathLike[str] = PROC,
                 note: Callable[[str], None] = stderr_note,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.timeout, self.clock = store, timeout, clock
        self.run_queue = RunQueue(proc, note)
        self.seen: dict[int, tuple[int, float]] = {}  # pid: (its count, when it last moved)
        self.windows: dict[int, Window] = {}  # pid: its threads' waits since it went silent
        self.last_look: float | None = None

    def stalled(self, pids: Iterable[int]) -> Stall | None:
        """The first stalled rank among `pids`, if any."""
        now = self.clock()
        if self.last_look is not None and now - self.last_look > self.timeout / 2:
            # The watch itself did not run (this process held off the CPU, the host
            # suspended): it saw no beat, which says nothing of the ranks. A fresh window.
            self.seen = {pid: (count, now) for pid, (count, _) in self.seen.items()}
            self.windows.clear()
        self.last_look = now
        for pid in pids:
            count = int(self.store.add(beat_key(pid), 0))
            if count == 0 or count >= EXITING:
                continue
            last = self.seen.get(pid)
            if last is None or last[0] != count:
                self.seen[pid] = (count, now)
                self.windows.pop(pid, None)
                continue
            silent = now - last[1]
            if silent < self.timeout * _READ_AFTER:
                continue
            waits = self.run_queue.waits(pid)
            window = self.windows.setdefault(pid, Window(waits, now))
            starved = min(window.waited(waits, now), STARVED_LIMIT_S)
            if silent - starved > self.timeout:
                return Stall(pid, silent, starved)
        return None

    def forget(self, pids: Iterable[int]) -> None:
        """Ranks that are gone (their pids may come again)."""
        for pid in pids:
            self.seen.pop(pid, None)
            self.windows.pop(pid, None)
            self.store.delete_key(beat_key(pid))


def serve() -> int:
    """The job's coordinator (lighthouse and record) for replica groups started by hand (one
    torchrun per group), on loopback or `PIPELINE_FT_BIND`, until SIGTERM or Ctrl-C; the
    first group to join sets the count. It prints what each group exports."""
    import signal
    import sys

    from pipeline.replicas.auth import bind_host
    from pipeline.replicas.coordinator import address, serve_coordinator
    from pipeline.replicas.tls import job_tls

    try:
        tls = job_tls()  # the job's certificate, which every group holds too
    except PipeConfigError as exc:
        print(f"pipeline.replica_launch: {exc}", file=sys.stderr, flush=True)
        return 2
    # The handlers first: a script that reads the line below and stops us at once must not
    # find the default action still in place (on a loaded host it killed this by the signal).
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    with serve_coordinator(host=bind_host(), tls=tls) as (server, _, _):
        print(f"export TORCHFT_LIGHTHOUSE={address(server)} {RECORD_ENV}={server.port}",
              flush=True)
        while not stop.wait(1.0):
            pass
    return 0
