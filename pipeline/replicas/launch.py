"""Replica groups on one host: the job's lighthouse, R pipelines of N ranks, lost groups restarted.

    python -m pipeline.launch --replicas 2 --nproc 2 --max-restarts 3 train.py

Each group has its own rendezvous store (a fresh one per start, so no failure report of a
lost incarnation reaches the next) and the environment `Pipe(..., fault_tolerance=True)`
reads: TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, and the port of the job's
record (record), which this process keeps for the whole job. When a rank of a group exits
non-zero or dies, the rest of that group is killed at once (its ranks cannot finish a step
without it; the survivors of other groups see a broken collective, not a hang) and the group
starts again, at most `max_restarts` times per group, if a live group still holds the job's
history to heal it from; the other groups keep training. When none does, the job ends with an
error: a group started again from its initial weights would silently begin another history.
A rank that stops beating into the record for `rank_timeout` seconds (stopped, or held off the
CPU) is taken for lost the same way: the lighthouse hears group rank 0's manager alone. With
spares (spares.py), a lost group's id goes to a waiting spare instead of a fresh start. A rank
that exits with a configuration error (CONFIG_EXIT) ends the job at once: a restart would
meet the same error.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import PipeConfigError
from pipeline.replicas.beats import LAUNCHER_ENV, LIVENESS_ENV
from pipeline.replicas.coordinator import address, serve_coordinator
from pipeline.replicas.environment import (
    LIGHTHOUSE_ENV,
    LOG_ENV,
    NUM_REPLICAS_ENV,
    REPLICA_ID_ENV,
    check_installed,
)
from pipeline.replicas.history_watch import Progress, Stuck, compare_ends, history_lost
from pipeline.replicas.record import (
    RECORD_ENV,
    REPLICAS_KEY,
    Liveness,
    group_key,
    hold_key,
)
from pipeline.replicas.spares import Spares, stop_ranks
from pipeline.replicas.tls import CERT_ENV, job_cert_env, job_tls, make_job_cert

__all__ = ["CONFIG_EXIT", "HEARTBEAT_TIMEOUT_MS", "JOIN_TIMEOUT_MS", "PROGRESS_TIMEOUT_S",
           "RANK_TIMEOUT_FLOOR_S", "RUST_LOG_DEFAULT", "ReplicaGroup", "is_config_error",
           "main", "rank_failed", "run_replicas"]

_log = logging.getLogger("pipeline.launch")

# The lighthouse drops a replica whose heartbeats stop for this long, and only then forms a
# quorum without it: the bound on a survivor's wait after a SIGKILL. torchft's default. At 1 s
# a loaded host stalled live groups' heartbeats often enough that two groups formed quorums
# alone, step after step, and never met again to heal (the job's record keeps them from
# committing two histories, but the lagging one then waits); `--heartbeat-timeout` trades
# that for a faster detection on a quiet host.
HEARTBEAT_TIMEOUT_MS = 5000
# How long a quorum waits for a replica that is alive (heartbeating) but has not asked to join
# yet: one still in its step, or starting. Short, two replicas each alone in a quorum at the
# same step would both commit it and from then on train apart (torchft 0.2's lighthouse has no
# majority rule); so a live replica is waited for as long as a step may take, and a dead one
# is dropped by its heartbeats.
JOIN_TIMEOUT_MS = 60_000
# A live group whose committed count has not moved for this long ends the job (exit 1): a
# group that can never commit again (retrying a step of another history, waiting for a heal
# nobody can give) retried forever before. Above the join timeout and a slow step; the
# launcher's --progress-timeout.
PROGRESS_TIMEOUT_S = 600.0

# A rank silent in the record for the heartbeat timeout, but never less than this, is taken
# for lost and its group restarted. Dearer than the lighthouse's drop from one quorum (a
# restart, and one of --max-restarts): a live rank held off the CPU for a second on a loaded
# host must not cost its group that, whatever `--heartbeat-timeout` buys for detection.
RANK_TIMEOUT_FLOOR_S = 5.0
_LIVENESS_LOOK_S = 0.25  # how often the beats are read
# A rank's exit status for a configuration error (sysexits' EX_CONFIG): the launcher does not
# restart its group, and exits with it too, so that a scheduler above does not retry either.
CONFIG_EXIT = 78

# Each rank runs its script through this: as `python script.py ARGS` (sys.argv, sys.path[0],
# __main__), but a ValueError or TypeError (PipeConfigError is one) that escapes it goes
# through rank_failed, which tells the launcher a configuration error from a failure. Nothing
# of the package is imported otherwise: the script may be one that never imports torch.
_BOOT = ("import os, runpy, sys\n"
         "sys.argv = sys.argv[1:]\n"
         "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))\n"
         "try:\n"
         "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
         "except (ValueError, TypeError) as exc:\n"
         "    from pipeline.replicas.launch import rank_failed\n"
         "    rank_failed(exc)\n")

# torchft's Rust side logs through RUST_LOG, at INFO by default (its lighthouse and managers,
# which this library replaces, logged a few lines per rank per step). Warnings and errors
# only, unless the user set it.
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
        by the same poll; then a configuration error, for the same reason."""
        failed = [(r, code) for r, p in enumerate(self.procs)
                  if (code := p.poll()) is not None and code != 0]
        return (min(failed, key=lambda f: (f[1] >= 0, f[1] != CONFIG_EXIT, f[0])) if failed
                else None)

    def stop(self, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
        """Signal every live rank and reap them all (killed after `wait` seconds)."""
        stop_ranks(self.procs, sig, wait)
        self.store = None  # the store lived as long as this incarnation's ranks


def is_config_error(exc: BaseException) -> bool:
    """Whether a rank's exception is one a restart would meet again: PipeConfigError (a wrong
    --nproc, a model that differs, counts that differ), or a plain ValueError or TypeError."""
    return isinstance(exc, (PipeConfigError, ValueError, TypeError))


def _error_key(pid: int) -> str:
    return f"error/{pid}"


def rank_failed(exc: Exception) -> None:
    """In a rank, for an exception that escaped its script: a configuration error is printed,
    written to the job's record for the launcher to name, and ends the rank with CONFIG_EXIT;
    anything else is raised again (exit code 1, the group restarts)."""
    if not is_config_error(exc):
        raise exc
    traceback.print_exception(exc)
    port = os.environ.get(RECORD_ENV)
    if port:
        with contextlib.suppress(Exception):  # the launcher gone: nobody to tell
            from pipeline.replicas.record import connect

            connect(int(port), 10.0).set(_error_key(os.getpid()),
                                         f"{type(exc).__name__}: {exc}"[:4000])
    sys.exit(CONFIG_EXIT)  # looked up now: a quiet exit (pipeline.comm.quiet_exit) records it


def _describe(code: int) -> str:
    return (f"killed by {signal.Signals(-code).name}" if code < 0
            else f"exit code {code}")


def run_replicas(script: str, args: Sequence[str], *, replicas: int, nproc: int,
                 max_restarts: int, init_timeout_env: dict[str, str],
                 heartbeat_timeout: float | None = None,
                 progress_timeout: float | None = None, spares: int = 0) -> int:
    """Run `script args` as `replicas` groups of `nproc` ranks, `spares` more waiting
    (spares); return the exit code."""
    check_installed("python -m pipeline.launch --replicas")
    if replicas < 1 or max_restarts < 0 or spares < 0:
        raise PipeConfigError(f"--replicas must be >= 1, --max-restarts >= 0 and --spares >= "
                              f"0; got --replicas {replicas}, --max-restarts {max_restarts}, "
                              f"--spares {spares}")
    beats = (HEARTBEAT_TIMEOUT_MS if heartbeat_timeout is None
             else max(1, round(heartbeat_timeout * 1e3)))
    # The job's certificate and key (tls): one per job, unless the user gave one to share
    # it with groups started elsewhere; in the ranks' environment (readable by this uid
    # alone), never on a command line or in a file.
    made = {} if os.environ.get(CERT_ENV, "").strip() else job_cert_env()
    tls = job_tls({**os.environ, **made})
    # The lighthouse and the job's record (its history outlives every group), in this
    # process, served on loopback to the job's processes alone (coordinator).
    with serve_coordinator(heartbeat_timeout_s=beats / 1e3, join_timeout_s=JOIN_TIMEOUT_MS / 1e3,
                           tls=tls) as (server, _, record):
        record.set(REPLICAS_KEY, str(replicas))  # a group started with another count is refused
        rank_timeout = max(beats / 1e3, RANK_TIMEOUT_FLOOR_S)
        env = {LIGHTHOUSE_ENV: address(server), NUM_REPLICAS_ENV: str(replicas),
               RUST_LOG_ENV: os.environ.get(RUST_LOG_ENV, RUST_LOG_DEFAULT),
               RECORD_ENV: str(server.port), LIVENESS_ENV: str(rank_timeout), LOG_ENV: "1",
               LAUNCHER_ENV: str(os.getpid()), **init_timeout_env, **made}
        return _supervise(script, args, replicas, nproc, max_restarts, env, record,
                          rank_timeout, PROGRESS_TIMEOUT_S if progress_timeout is None
                          else progress_timeout, spares)


def _supervise(script: str, args: Sequence[str], replicas: int, nproc: int,
               max_restarts: int, env: dict[str, str], record: Any,
               rank_timeout: float, progress_timeout: float, spares: int) -> int:
    """Start the groups and spares, hand a lost group's id to a spare or restart it, and end
    the job (its exit code)."""
    argv = [sys.executable, "-c", _BOOT, script, *args]
    groups = [ReplicaGroup(r) for r in range(replicas)]
    stopping: list[int] = []  # a signal the launcher was sent: passed on to every rank
    handlers = {sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    for g in groups:
        g.start(argv, nproc, env)
    liveness = Liveness(record, rank_timeout)
    # Spares after the groups: the groups' ranks start first on a loaded host.
    waiting = Spares(spares, argv, nproc, env, record, liveness, replicas, max_restarts)
    waiting.fill()
    print(f"pipeline.launch: {replicas} replica groups x {nproc} ranks"
          f"{f', {spares} spare group(s)' if spares else ''}; lighthouse "
          f"{env[LIGHTHOUSE_ENV]}", file=sys.stderr)
    stuck = Stuck(record, groups, nproc)
    progress = Progress(record, groups, nproc, progress_timeout)
    next_look = 0.0
    try:
        while not all(g.done for g in groups):
            if stopping:
                waiting.stop(stopping[0])
                return _stopped(groups, stopping[0])
            why = stuck.check() or progress.check()
            if why is not None:
                return _end(groups, why)
            look = time.monotonic() >= next_look
            next_look = time.monotonic() + _LIVENESS_LOOK_S if look else next_look
            waiting.watch(look)
            for g in groups:
                if g.done:
                    continue
                lost = g.failed_rank()
                if lost is not None:
                    rank, code = lost
                    if code == CONFIG_EXIT:
                        return _config_error(record, groups, g, rank)
                    how = _describe(code)
                elif look and (stall := _stalled(liveness, g)) is not None:
                    rank, silent, starved = stall
                    how = (f"stalled: no beat for {silent:.1f}s ({starved:.1f}s of it waiting "
                           f"for a CPU), stopped or frozen; its group killed")
                else:
                    if all(p.poll() == 0 for p in g.procs):
                        g.done = True
                    continue
                pids = [p.pid for p in g.procs]
                g.stop()  # the rest of its group: they cannot step without it
                liveness.forget(pids)
                g.failures.append(f"rank {rank} {how}")
                if len(g.failures) > max_restarts:
                    return _give_up(groups, g, max_restarts)
                unhealable = history_lost(record, groups, g, nproc)
                if unhealable is not None:
                    return _end(groups, f"replica group {g.replica_id} lost rank {rank} "
                                        f"({how}); {unhealable}")
                for r in range(nproc):  # it holds no history now (a heal in part undone)
                    record.set(group_key(g.replica_id, r), "0 0")
                    record.delete_key(hold_key(g.replica_id, r))
                spare = waiting.take(g.replica_id)  # a restart too, without the start
                what = ("restarting it" if spare is None
                        else f"spare group {spare.number} takes its place")
                print(f"pipeline.launch: replica group {g.replica_id} lost rank {rank} "
                      f"({how}); {what} (restart {len(g.failures)} of at most "
                      f"{max_restarts})", file=sys.stderr)
                if spare is None:
                    g.start(argv, nproc, env)
                else:
                    g.procs, g.store = spare.procs, spare.store
                progress.restarted(g)
            time.sleep(0.05)
        waiting.end()
        return compare_ends(record, groups, nproc)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        waiting.stop(signal.SIGTERM)
        for g in groups:
            g.stop(signal.SIGTERM if stopping else signal.SIGKILL)


def _stalled(liveness: Liveness, group: ReplicaGroup) -> tuple[int, float, float] | None:
    """(rank, seconds silent, seconds of them it waited for a CPU) of a rank of `group` that
    stopped beating, if any."""
    ranks = {p.pid: r for r, p in enumerate(group.procs) if p.poll() is None}
    stall = liveness.stalled(ranks)
    return None if stall is None else (ranks[stall.pid], stall.silent, stall.starved)


def _config_error(record: Any, groups: list[ReplicaGroup], group: ReplicaGroup,
                  rank: int) -> int:
    """End the job for a rank's configuration error, naming it: not retried."""
    key = _error_key(group.procs[rank].pid)
    error = (record.get(key).decode() if record.check([key])
             else "(not recorded: its own lines above say what it was)")
    _end(groups, f"replica group {group.replica_id} rank {rank}: configuration error (exit "
                 f"code {CONFIG_EXIT}), not retried: {error}; fix it and start the job again")
    return CONFIG_EXIT


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


def _record_parser() -> argparse.ArgumentParser:
    """`python -m pipeline.replica_launch`'s options: `--record` or `--make-cert` (groups
    started by this module's `run_replicas` come from `python -m pipeline.launch --replicas`)."""
    from pipeline.replicas.auth import BIND_ENV
    from pipeline.replicas.record import RECORD_ENV

    parser = argparse.ArgumentParser(
        prog="python -m pipeline.replica_launch",
        description="Serve the job's coordinator (its lighthouse and record) alone, for replica "
                    "groups started by hand (one torchrun per group); it prints the line each "
                    f"group exports (TORCHFT_LIGHTHOUSE and {RECORD_ENV}) and serves until "
                    "SIGTERM or Ctrl-C. Groups started together on one host: python -m "
                    "pipeline.launch --replicas R --nproc N script.py (docs/fault-tolerance.md).",
        epilog=f"environment: {CERT_ENV} the job's certificate and key (PEM, from --make-cert), "
               f"the same in every group and the coordinator: every connection of the job is "
               f"mutual TLS under it; {BIND_ENV} the address to bind for groups on several "
               f"hosts (default: loopback)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true",
                      help=f"serve the job's lighthouse and record (needs {CERT_ENV})")
    mode.add_argument("--make-cert", action="store_true",
                      help=f"print a fresh job certificate and key (PEM) to export as {CERT_ENV} "
                           f"to the coordinator and every group, privately")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pipeline.replica_launch --record | --make-cert`."""
    options = _record_parser().parse_args(argv)
    if options.make_cert:
        sys.stdout.write(make_job_cert())
        return 0
    from pipeline.replicas.record import serve

    return serve()


if __name__ == "__main__":
    raise SystemExit(main())
