"""Replica groups on one host: a torchft lighthouse, R pipelines of N ranks, lost groups restarted.

    python -m pipeline.launch --replicas 2 --nproc 2 --max-restarts 3 train.py

Each group has its own rendezvous store (a fresh one per start, so no failure report of a
lost incarnation reaches the next) and the environment `Pipe(..., fault_tolerance=True)`
reads: TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, and the port of the job's
record (ft_record), which this process keeps for the whole job. When a rank of a group exits
non-zero or dies, the rest of that group is killed at once (its ranks cannot finish a step
without it; the survivors of other groups see a broken collective, not a hang) and the group
starts again, at most `max_restarts` times per group, if a live group still holds the job's
history to heal it from; the other groups keep training. When none does, the job ends with an
error: a group started again from its initial weights would silently begin another history.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import PipeConfigError
from pipeline.parallel.fault_tolerance import (
    LIGHTHOUSE_ENV,
    LOG_ENV,
    NUM_REPLICAS_ENV,
    REPLICA_ID_ENV,
    check_installed,
)
from pipeline.parallel.ft_record import RECORD_ENV, group_key, read_record

__all__ = ["HEARTBEAT_TIMEOUT_MS", "JOIN_TIMEOUT_MS", "RUST_LOG_DEFAULT", "ReplicaGroup",
           "run_replicas"]

_log = logging.getLogger("pipeline.launch")

# The lighthouse drops a replica whose heartbeats stop for this long, and only then forms a
# quorum without it: the bound on a survivor's wait after a SIGKILL. torchft's default. At 1 s
# a loaded host stalled live groups' heartbeats often enough that two groups formed quorums
# alone, step after step, and never met again to heal (the job's record keeps them from
# committing two histories, but the lagging one then waits); `--heartbeat-timeout` trades
# that for a faster detection on a quiet host.
HEARTBEAT_TIMEOUT_MS = 5000
# After a group is lost, how long the live groups get to show (in the record) that one of
# them holds the job's history, before the job is declared unable to heal: a group writes
# its count just after its commit, and the lost one may have written first.
HISTORY_GRACE_S = 20.0
# How long a quorum waits for a replica that is alive (heartbeating) but has not asked to join
# yet: one still in its step, or starting. Short, two replicas each alone in a quorum at the
# same step would both commit it and from then on train apart (torchft 0.2's lighthouse has no
# majority rule); so a live replica is waited for as long as a step may take, and a dead one
# is dropped by its heartbeats.
JOIN_TIMEOUT_MS = 60_000

# torchft's Rust side (lighthouse, managers) logs through RUST_LOG, at INFO by default: a few
# lines per rank per step, thousands a run. Warnings and errors only, unless the user set it.
RUST_LOG_ENV, RUST_LOG_DEFAULT = "RUST_LOG", "warn"


@dataclass
class ReplicaGroup:
    """One replica group's current processes, its store, and its failures so far."""

    replica_id: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    store: Any = None
    failures: list[str] = field(default_factory=list)
    done: bool = False

    def start(self, argv: list[str], nproc: int, env: dict[str, str]) -> None:
        from pipeline.launch import host_store, rank_env

        self.store, port = host_store()
        group_env = {REPLICA_ID_ENV: str(self.replica_id), **env}
        self.procs = [subprocess.Popen(argv, env={**os.environ, **rank_env(r, nproc, port),
                                                  **group_env})
                      for r in range(nproc)]

    def failed_rank(self) -> tuple[int, int] | None:
        """(rank, exit code) of a rank that exited non-zero, if any: one killed by a signal
        first, since its peers then fail on their own (exit code 1) and may all be seen gone
        by the same poll."""
        failed = [(r, code) for r, p in enumerate(self.procs)
                  if (code := p.poll()) is not None and code != 0]
        return min(failed, key=lambda f: (f[1] >= 0, f[0])) if failed else None

    def stop(self, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
        """Signal every live rank and reap them all (killed after `wait` seconds)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + wait
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.store = None  # the store lived as long as this incarnation's ranks


def _describe(code: int) -> str:
    return (f"killed by {signal.Signals(-code).name}" if code < 0
            else f"exit code {code}")


def run_replicas(script: str, args: Sequence[str], *, replicas: int, nproc: int,
                 max_restarts: int, init_timeout_env: dict[str, str],
                 heartbeat_timeout: float | None = None) -> int:
    """Run `script args` as `replicas` groups of `nproc` ranks; return the exit code."""
    from pipeline.launch import host_store

    check_installed("python -m pipeline.launch --replicas")
    if replicas < 1 or max_restarts < 0:
        raise PipeConfigError(f"--replicas must be >= 1 and --max-restarts >= 0; got "
                              f"--replicas {replicas}, --max-restarts {max_restarts}")
    rust_log = os.environ.get(RUST_LOG_ENV, RUST_LOG_DEFAULT)
    beats = (HEARTBEAT_TIMEOUT_MS if heartbeat_timeout is None
             else max(1, round(heartbeat_timeout * 1e3)))
    lighthouse = _lighthouse(rust_log, beats)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    record, record_port = host_store()  # the job's history outlives every group
    env = {LIGHTHOUSE_ENV: address, NUM_REPLICAS_ENV: str(replicas), RUST_LOG_ENV: rust_log,
           RECORD_ENV: str(record_port), LOG_ENV: "1", **init_timeout_env}
    argv = [sys.executable, script, *args]
    groups = [ReplicaGroup(r) for r in range(replicas)]
    stopping: list[int] = []  # a signal the launcher was sent: passed on to every rank
    handlers = {sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    for g in groups:
        g.start(argv, nproc, env)
    print(f"pipeline.launch: {replicas} replica groups x {nproc} ranks; lighthouse "
          f"{address}", file=sys.stderr)
    stuck = _Stuck(record, groups)
    try:
        while not all(g.done for g in groups):
            if stopping:
                return _stopped(groups, stopping[0])
            why = stuck.check()
            if why is not None:
                return _end(groups, why)
            for g in groups:
                if g.done:
                    continue
                lost = g.failed_rank()
                if lost is not None:
                    rank, code = lost
                    g.stop()  # the rest of its group: they cannot step without it
                    g.failures.append(f"rank {rank} {_describe(code)}")
                    if len(g.failures) > max_restarts:
                        return _give_up(groups, g, max_restarts)
                    unhealable = _history_lost(record, groups, g)
                    if unhealable is not None:
                        return _end(groups, f"replica group {g.replica_id} lost rank {rank} "
                                            f"({_describe(code)}); {unhealable}")
                    print(f"pipeline.launch: replica group {g.replica_id} lost rank {rank} "
                          f"({_describe(code)}); restarting it (restart "
                          f"{len(g.failures)} of at most {max_restarts})", file=sys.stderr)
                    record.set(group_key(g.replica_id), "0 0")  # it holds no history now
                    g.start(argv, nproc, env)
                elif all(p.poll() == 0 for p in g.procs):
                    g.done = True
            time.sleep(0.05)
        return _compare_ends(record, groups)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for g in groups:
            g.stop(signal.SIGTERM if stopping else signal.SIGKILL)
        lighthouse.shutdown()


class _Stuck:
    """Live groups that can never reach the job's history: every group holding it finished,
    so none is left in a quorum to heal them (they would retry their step forever)."""

    def __init__(self, record: Any, groups: list[ReplicaGroup]) -> None:
        self.record, self.groups = record, groups
        self.next_look = 0.0
        self.since: float | None = None

    def check(self) -> str | None:
        now = time.monotonic()
        if now < self.next_look:
            return None
        self.next_look = now + 0.5
        counts = {g: entry[0] for g, entry in read_record(self.record, len(self.groups)).items()}
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


def _history_lost(record: Any, groups: list[ReplicaGroup], lost: ReplicaGroup) -> str | None:
    """Why no group can heal `lost` (None if a live group holds the job's history), waiting
    up to HISTORY_GRACE_S for a live group's count to show it."""
    deadline = time.monotonic() + HISTORY_GRACE_S
    while True:
        counts = {g: entry[0] for g, entry in read_record(record, len(groups)).items()}
        latest = max(counts.values(), default=0)
        live = [g for g in groups if g is not lost and not g.done and g.failed_rank() is None]
        if latest == 0 or any(counts.get(g.replica_id, 0) == latest for g in live):
            return None
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    finished = [g.replica_id for g in groups if g.done]
    if finished:
        return (f"the job's other group(s) {finished} finished at {latest} committed steps "
                f"and no live group holds that history to heal it from (started again, it "
                f"would train from its initial weights alone): the finished groups' weights "
                f"are the job's result")
    return (f"no live group holds the job's history ({latest} committed steps; each group's "
            f"count: {counts}), so none can be healed: resume the job from its last sharded "
            f"checkpoint (pipe.save / pipe.load, docs/checkpoints.md)")


def _compare_ends(record: Any, groups: list[ReplicaGroup]) -> int:
    """0 if every group ended holding the same history (count and lineage), else 1."""
    ends = read_record(record, len(groups))
    if len(set(ends.values())) <= 1:
        return 0
    print(f"pipeline.launch: the replica groups ended with different histories (committed "
          f"steps, lineage): {ends}; their weights differ", file=sys.stderr)
    return 1


def _end(groups: list[ReplicaGroup], why: str) -> int:
    """Stop every group (SIGTERM, then SIGKILL) and say why the job cannot go on."""
    for g in groups:
        if not g.done:
            g.stop(signal.SIGTERM)
    print(f"pipeline.launch: {why}. The other groups were stopped.", file=sys.stderr)
    return 1


def _stopped(groups: list[ReplicaGroup], signum: int) -> int:
    """The launcher was sent `signum`: every rank gets it, and is waited for."""
    for g in groups:
        if not g.done:
            g.stop(signum)
    print(f"pipeline.launch: stopped by {signal.Signals(signum).name}; every rank was sent "
          f"it and has exited", file=sys.stderr)
    return 128 + signum


def _lighthouse(rust_log: str, heartbeat_timeout_ms: int) -> Any:
    """torchft's lighthouse in this process, logging at `rust_log` (its logger reads RUST_LOG
    when torchft is first imported; the variable is restored after, for a caller in the same
    process)."""
    before = os.environ.get(RUST_LOG_ENV)
    os.environ[RUST_LOG_ENV] = rust_log
    try:
        from torchft.coordination import LighthouseServer

        # min_replicas=1: a quorum of the survivors alone is a quorum (that is the point).
        # On loopback: every group runs on this host, and the lighthouse authenticates no
        # one. Its address() names the host, which may resolve to another interface: callers
        # use the port alone.
        return LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                                join_timeout_ms=JOIN_TIMEOUT_MS,
                                heartbeat_timeout_ms=heartbeat_timeout_ms)
    finally:
        if before is None:
            del os.environ[RUST_LOG_ENV]
        else:
            os.environ[RUST_LOG_ENV] = before


def _give_up(groups: list[ReplicaGroup], lost: ReplicaGroup, max_restarts: int) -> int:
    """Stop every other group cleanly (SIGTERM, then SIGKILL) and say what failed."""
    for g in groups:
        if g is not lost and not g.done:
            g.stop(signal.SIGTERM)
    failures = "; ".join(f"group {g.replica_id}: {', '.join(g.failures)}"
                         for g in groups if g.failures)
    print(f"pipeline.launch: replica group {lost.replica_id} failed after {max_restarts} "
          f"restart(s) (--max-restarts {max_restarts}); failures: {failures}. The other "
          f"groups were stopped.", file=sys.stderr)
    return 1
