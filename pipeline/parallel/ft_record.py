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

The record also holds what every group must agree on and what the lighthouse cannot see. The
job's count of groups (`replicas`): the first to join (the launcher) writes it, and a group
started with another NUM_REPLICA_GROUPS is refused at join. Every rank's liveness (`beat/<pid>`):
torchft heartbeats the lighthouse from group rank 0 alone, so a stalled rank 1 held every
replica until the Pipe's timeout; each rank beats here from a daemon thread, which a stall of
the process (SIGSTOP, a rank held off the CPU) stops too, and the launcher ends a group whose
rank has not beaten for its timeout (`Liveness`). A beat tied to progress would not do: a live
rank waits in a quorum for up to a minute for a group that is starting.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from pipeline import settings
from pipeline.errors import PipeConfigError, PipelineError

__all__ = ["EXITING", "LIVENESS_ENV", "RECORD_ENV", "REPLICAS_KEY", "JobRecord", "Liveness",
           "NotLatest", "beat_key", "connect", "group_key", "read_record", "serve"]

RECORD_ENV = "PIPELINE_FT_RECORD"  # the record's port, on the lighthouse's host
# Seconds a rank may go without a beat before the launcher ends its group; set by the launcher
# (unset: no beats, as under torchrun by hand).
LIVENESS_ENV = "PIPELINE_FT_LIVENESS"
REPLICAS_KEY = "replicas"  # the job's count of replica groups
# fault_tolerance.NUM_REPLICAS_ENV (that module imports this one).
_NUM_REPLICAS_ENV = "NUM_REPLICA_GROUPS"
# Added to a rank's beat count as it exits: from then on it is not watched (its teardown may
# take longer than the timeout, with its beating thread already stopped by the interpreter).
EXITING = 1 << 40
_BEATS_PER_TIMEOUT = 10
_EXIT_JOIN_S = 10.0  # how long an exiting rank waits for a beat in flight
_beating: set[int] = set()  # this process's pid once its beats started (a fork beats anew)


class NotLatest(PipelineError):
    """This group does not hold the job's latest history: it must heal before committing."""


def group_key(replica: int) -> str:
    return f"group/{replica}"


def beat_key(pid: int) -> str:
    return f"beat/{pid}"


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
    """A rank's view of the record (None where none is kept: torchrun by hand, unless the
    record is started alone, `python -m pipeline.replica_launch --record`)."""

    def __init__(self, store: Any, replica: int) -> None:
        self.store, self.replica = store, replica

    @classmethod
    def from_environment(cls, replica: int, timeout: float) -> JobRecord | None:
        port = os.environ.get(RECORD_ENV)
        if not port:
            return None
        store = connect(int(port), timeout)
        _check_count(store, replica)
        liveness = settings.number(LIVENESS_ENV, default=None, low=0.001, high=86400,
                                   unit=" seconds")
        if liveness is not None and os.getpid() not in _beating:
            _beating.add(os.getpid())
            _start_beats(int(port), liveness / _BEATS_PER_TIMEOUT, timeout, store)
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


def connect(port: int, timeout: float) -> Any:
    """A client of the record kept by the job's coordinator at `port` on the lighthouse's host
    (ft_coord: the same server, under the job's TLS)."""
    from pipeline.parallel.ft_coord import StoreClient, lighthouse_hostport

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


def _start_beats(port: int, period: float, timeout: float, store: Any) -> None:
    """Beat every `period` seconds from a daemon thread (a SIGSTOP stops it with the rest of
    the process), on a connection of its own: the rank's calls never wait behind a beat. At
    exit the thread is stopped first, then the rank says so on its own connection: its
    teardown is not watched."""
    key = beat_key(os.getpid())
    stop = threading.Event()

    def beat() -> None:
        try:
            beats = connect(port, timeout)
            while not stop.is_set():
                beats.add(key, 1)
                stop.wait(period)
        except Exception:  # the launcher is gone: the job is ending, nobody watches
            return

    thread = threading.Thread(target=beat, name="pipeline-ft-beat", daemon=True)

    def exiting() -> None:
        # Joined before the interpreter finalizes: a daemon thread still inside the store's
        # call then (which let go of the GIL) is ended by pthread_exit as it takes the GIL
        # back, through C++ frames that may not unwind: the rank aborts ("terminate called
        # without an active exception"), after its last commit.
        stop.set()
        thread.join(timeout=_EXIT_JOIN_S)
        with contextlib.suppress(Exception):
            store.add(key, EXITING)

    atexit.register(exiting)
    thread.start()


class Liveness:
    """The launcher's watch on the ranks' beats: a rank whose count has not moved for
    `timeout` seconds while the watch looked is stalled (a rank not yet beating, or exiting,
    is not watched)."""

    def __init__(self, store: Any, timeout: float) -> None:
        self.store, self.timeout = store, timeout
        self.seen: dict[int, tuple[int, float]] = {}  # pid: (its count, when it last moved)
        self.last_look: float | None = None

    def stalled(self, pids: Iterable[int]) -> tuple[int, float] | None:
        """(pid, seconds silent) of a stalled rank among `pids`, if any."""
        now = time.monotonic()
        if self.last_look is not None and now - self.last_look > self.timeout / 2:
            # The watch itself did not run (this process held off the CPU, the host
            # suspended): it saw no beat, which says nothing of the ranks. A fresh window.
            self.seen = {pid: (count, now) for pid, (count, _) in self.seen.items()}
        self.last_look = now
        for pid in pids:
            count = int(self.store.add(beat_key(pid), 0))
            if count == 0 or count >= EXITING:
                continue
            last = self.seen.get(pid)
            if last is None or last[0] != count:
                self.seen[pid] = (count, now)
            elif now - last[1] > self.timeout:
                return pid, now - last[1]
        return None

    def forget(self, pids: Iterable[int]) -> None:
        """Ranks that are gone (their pids may come again)."""
        for pid in pids:
            self.seen.pop(pid, None)
            self.store.delete_key(beat_key(pid))


def serve() -> int:
    """The job's coordinator (lighthouse and record) for replica groups started by hand (one
    torchrun per group), on loopback or `PIPELINE_FT_BIND`, until SIGTERM or Ctrl-C; the
    first group to join sets the count. It prints what each group exports."""
    import signal
    import sys

    from pipeline.parallel.ft_auth import bind_host
    from pipeline.parallel.ft_coord import address, serve_coordinator
    from pipeline.parallel.ft_tls import job_tls

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
