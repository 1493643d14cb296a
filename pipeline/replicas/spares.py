"""Warm spares: replica groups started ahead, waiting built, that take a lost group's id at once.

`python -m pipeline.launch --replicas R --nproc N --spares K` starts K spare groups of N ranks
beside the R replica groups. A spare's ranks run the script as any group's do, with
`PIPELINE_FT_SPARE` (the spare's number) in place of `REPLICA_GROUP_ID`: they import, build
their model and their Pipe, and `Pipe(fault_tolerance=True)` waits (`await_replica_id`), at the
last point before the replica id is needed (its torchft Manager is named by it), for the
launcher to write one to the job's record (`spare/<number>`, under the job's TLS like every
record key). Meanwhile a spare is in no quorum, trains nothing and is not one of the R; its
ranks beat into the record as every rank does, so a spare that stalls is seen. When a group is
lost the launcher writes the lost id there (`Spares.take`): the spare's ranks go on from their
wait as that group (the id picks their data through `pipe.replica_id`), heal from a live group
at their first quorum, and train; the launcher starts a spare in its place once that group
holds the job's history again (the heal gets the CPUs first), or after `REFILL_AFTER_S`. A
spare lost while it waits is started again, no group's restart and no alarm to the job, up
to --max-restarts such losses per job; a job that ends writes `end` there, and each waiting
spare's ranks exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from pipeline.errors import PipeConfigError
from pipeline.replicas.beats import start_beating
from pipeline.replicas.environment import REPLICA_ID_ENV
from pipeline.replicas.record import PARTIAL, RECORD_ENV, Liveness, connect, read_record

__all__ = ["ENDED", "REFILL_AFTER_S", "SPARE_ENV", "Spare", "Spares", "await_replica_id",
           "ready_key", "reap_ranks", "spare_key", "stop_ranks"]

SPARE_ENV = "PIPELINE_FT_SPARE"  # a spare's number, in its ranks' environment
ENDED = "end"  # written in place of a replica id: the job ended, the spare's ranks exit 0
# A spare is started in place of one taken once the group that took it holds the job's history
# again, or this many seconds after it was taken, whichever comes first.
REFILL_AFTER_S = 30.0
_WAIT_S = 30.0  # one request's wait at the coordinator; the spare then asks again


def spare_key(number: int) -> str:
    """The record's key where the launcher writes spare `number`'s replica id (or ENDED)."""
    return f"spare/{number}"


def ready_key(number: int) -> str:
    """Counts spare `number`'s ranks that reached their wait."""
    return f"spare/{number}/ready"


def await_replica_id(timeout: float, rank: int) -> None:
    """In a spare's rank (PIPELINE_FT_SPARE set): beat, say this rank is ready, and wait for
    the launcher's word; then run on as the replica group it names (REPLICA_GROUP_ID set), or
    exit 0 if the job ended first. Elsewhere it returns at once."""
    raw = os.environ.get(SPARE_ENV)
    if raw is None:
        return
    port = os.environ.get(RECORD_ENV, "")
    if not (raw.isdigit() and port.isdigit()):
        raise PipeConfigError(
            f"a spare group's rank needs {SPARE_ENV} (its number) and {RECORD_ENV} (the job's "
            f"record), both integers, as `python -m pipeline.launch --replicas R --spares K` "
            f"sets them; got {SPARE_ENV}={raw!r}, {RECORD_ENV}={port!r}: start spares with "
            f"the launcher, or unset {SPARE_ENV}")
    number = int(raw)
    start_beating(int(port), timeout, f"spare group {number}", rank)
    record = connect(int(port), timeout)
    record.add(ready_key(number), 1)
    value = None
    while value is None:
        value = record.wait(spare_key(number), _WAIT_S)
    record.close()
    if value.decode() == ENDED:
        raise SystemExit(0)  # not needed: the script's own exit path, as a finished rank's
    os.environ[REPLICA_ID_ENV] = value.decode()
    del os.environ[SPARE_ENV]


def stop_ranks(procs: list[subprocess.Popen[bytes]], sig: int, wait: float) -> list[int]:
    """Signal every live one of `procs`, then reap them all (`reap_ranks`); their codes."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    return reap_ranks(procs, wait)


def reap_ranks(procs: list[subprocess.Popen[bytes]], wait: float) -> list[int]:
    """Wait for every one of `procs` to exit (killed after `wait` seconds); their codes."""
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


@dataclass
class Spare:
    """One spare group's ranks and its rendezvous store, while it waits."""

    number: int
    procs: list[subprocess.Popen[bytes]]
    store: Any
    ready: bool = False

    def stop(self, sig: int = signal.SIGKILL, wait: float = 10.0) -> list[int]:
        """Signal every live rank, reap them all (killed after `wait` seconds); their codes."""
        return stop_ranks(self.procs, sig, wait)

    def reap(self, wait: float) -> list[int]:
        """Wait for every rank to exit (killed after `wait` seconds); their exit codes."""
        return reap_ranks(self.procs, wait)


class Spares:
    """The launcher's spares: started, watched while they wait, handed a lost group's id,
    refilled, and ended with the job."""

    def __init__(self, count: int, argv: list[str], nproc: int, env: dict[str, str],
                 record: Any, liveness: Liveness, replicas: int, max_losses: int) -> None:
        if count < 0:
            raise PipeConfigError(f"--spares must be >= 0 (spare groups to keep waiting); "
                                  f"got {count}")
        self.count, self.argv, self.nproc, self.env = count, argv, nproc, env
        self.record, self.liveness, self.replicas = record, liveness, replicas
        self.max_losses, self.losses = max_losses, 0
        self.waiting: list[Spare] = []
        self.refills: list[tuple[int, float]] = []  # (replica id that took one, when)
        self._next = 0

    def fill(self) -> None:
        """Start spares until `count` wait or are owed a refill (none once the losses
        allowed are spent)."""
        while (len(self.waiting) + len(self.refills) < self.count
               and self.losses <= self.max_losses):
            self._start()

    def _start(self) -> None:
        from pipeline.launch import host_store, rank_env

        store, port = host_store()
        number, self._next = self._next, self._next + 1
        env = {**self.env, SPARE_ENV: str(number)}
        env.pop(REPLICA_ID_ENV, None)
        procs = [subprocess.Popen(self.argv, env={**{k: v for k, v in os.environ.items()
                                                     if k != REPLICA_ID_ENV},
                                                  **rank_env(r, self.nproc, port), **env})
                 for r in range(self.nproc)]
        self.waiting.append(Spare(number, procs, store))

    def pids(self) -> list[int]:
        return [p.pid for s in self.waiting for p in s.procs]

    def take(self, replica_id: int) -> Spare | None:
        """A waiting spare (a ready one first, else the oldest still starting), handed
        `replica_id`; None when none waits."""
        live = [s for s in self.waiting if all(p.poll() is None for p in s.procs)]
        if not live:
            return None
        spare = next((s for s in live if s.ready), live[0])
        self.waiting.remove(spare)
        self.record.set(spare_key(spare.number), str(replica_id))
        self.refills.append((replica_id, time.monotonic()))
        return spare

    def watch(self, look: bool) -> None:
        """Replace a spare lost while it waits (a rank that exited; with `look`, one that
        stopped beating): the job goes on as it was. With `look`, also refill and note the
        spares that became ready (the record is read only then)."""
        if look:
            self._refill()
        for spare in list(self.waiting):
            how = None
            for r, p in enumerate(spare.procs):
                code = p.poll()
                if code is not None:  # a spare's rank exits only when told to
                    how = f"rank {r} " + (f"killed by {signal.Signals(-code).name}" if code < 0
                                          else f"exit code {code}")
                    break
            if how is None and look:
                ranks = {p.pid: r for r, p in enumerate(spare.procs)}
                stall = self.liveness.stalled(ranks)
                if stall is not None:
                    how = f"rank {ranks[stall[0]]} stalled: no beat for {stall[1]:.1f}s"
            if how is not None:
                self._lost(spare, how)
            elif look and not spare.ready and int(
                    self.record.add(ready_key(spare.number), 0)) >= self.nproc:
                spare.ready = True
                print(f"pipeline.launch: spare group {spare.number} ready (its {self.nproc} "
                      f"rank(s) built their Pipe and wait for a lost group's id)",
                      file=sys.stderr)

    def _lost(self, spare: Spare, how: str) -> None:
        spare.stop()
        self.liveness.forget([p.pid for p in spare.procs])
        self.waiting.remove(spare)
        self.losses += 1
        more = (f"spare group {self._next} starts in its place (spare loss {self.losses} of "
                f"at most {self.max_losses})" if self.losses <= self.max_losses else
                f"no more spares are started (--max-restarts {self.max_losses} spare losses "
                f"spent); the job goes on without")
        print(f"pipeline.launch: spare group {spare.number} lost {how} while it waited; it "
              f"held no replica's state, the job goes on as it was; {more}", file=sys.stderr)
        self.fill()

    def _refill(self) -> None:
        """Spares owed for the ones taken: started once the group that took one holds the
        job's history (its heal had the CPUs), or REFILL_AFTER_S after it was taken."""
        if not self.refills:
            return
        now = time.monotonic()
        entries = read_record(self.record, self.replicas, self.nproc)
        latest = max((c for c, _ in entries.values()), default=0)
        for replica_id, since in list(self.refills):
            count, lineage = entries.get(replica_id, (0, PARTIAL))
            if (count == latest and lineage != PARTIAL and latest > 0) or \
                    now - since > REFILL_AFTER_S:
                self.refills.remove((replica_id, since))
                self.fill()

    def end(self, wait: float = 30.0) -> None:
        """The job ended: each waiting spare is told so and its ranks exit 0 (killed after
        `wait` seconds); the launcher says how each ended."""
        for spare in self.waiting:
            self.record.set(spare_key(spare.number), ENDED)
        for spare in self.waiting:
            codes = spare.reap(wait)
            how = ("its ranks exited 0" if all(c == 0 for c in codes)
                   else f"its ranks' exit codes {codes}")
            print(f"pipeline.launch: spare group {spare.number} ended with the job ({how})",
                  file=sys.stderr)
        self.waiting = []

    def stop(self, sig: int) -> None:
        """Every waiting spare's ranks get `sig` and are reaped (killed after 10 s)."""
        for spare in self.waiting:
            spare.stop(sig)
        self.waiting = []
