"""Start N local ranks on CPU (gloo over loopback): a CLI like torchrun, and `spawn` for code.

    python -m pipeline.launch --nproc 2 train.py --steps 10
    python -m pipeline.launch --replicas 2 --nproc 2 --max-restarts 3 train.py   # torchft
    python -m pipeline.launch --replicas 2 --nproc 2 --spares 1 train.py         # + a spare


Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
gloo bound to the loopback interface, one intra-op thread unless OMP_NUM_THREADS is set, and
glibc's allocator told to keep freed memory (`ALLOCATOR`) unless those variables are set.
The launcher itself hosts the rendezvous store, listening on 127.0.0.1 only (as torchrun's
agent hosts it), so the store outlives any rank and nothing off this machine can reach it.
If a rank fails, the others are given a few seconds to report their own error, then stopped.
With --replicas, R groups of N ranks train one model under torchft and a lost group is
restarted while the others go on, or its place taken at once by a spare group that waits
built (--spares; pipeline/replicas/launch.py, docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from pipeline import private_net, settings
from pipeline.comm.bootstrap import INIT_TIMEOUT_ENV, MAX_INIT_TIMEOUT

__all__ = ["ALLOCATOR", "GRACE_S", "INIT_TIMEOUT_ENV", "RankFailed", "describe_exit",
           "exit_status", "free_port", "host_store", "main", "rank_env", "spawn"]

_log = logging.getLogger(__name__)
# Seconds the other ranks get after one fails, to report their own error: the CLI's and
# `spawn`'s default alike.
GRACE_S = 15.0


class RankFailed(RuntimeError):
    """One or more spawned ranks raised or died; the message holds each one's error and
    `results` what the other ranks returned."""

    def __init__(self, message: str, results: dict[int, Any]) -> None:
        super().__init__(message)
        self.results = results


def describe_exit(code: int) -> str:
    """How a rank ended, from its exit code: "exited with code 3", or the signal that killed
    it by name ("was killed by SIGABRT (signal 6) ...")."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"was killed by signal {-code}"
    why = {signal.SIGABRT: ": it aborted (its own last lines above say why, such as "
                           "'terminate called ...' from a C++ library)",
           signal.SIGKILL: ": killed from outside (the out-of-memory killer, or a user)",
           signal.SIGSEGV: ": a crash in native code"}.get(sig, "")
    return f"was killed by {sig.name} (signal {-code}){why}"


def exit_status(code: int) -> int:
    """A rank's exit code as a process's exit status: a signal N as 128 + N, as shells do
    (a negative status would wrap around to 256 - N)."""
    return 128 - code if code < 0 else code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_store() -> tuple[Any, int]:
    """A rendezvous store served by this process on 127.0.0.1 only, and its port.

    torch's own TCPStore server listens on every interface; handing it a socket already bound
    to loopback keeps it there. Ranks started with `rank_env` connect to it as clients
    (`TORCHELASTIC_USE_AGENT_STORE`), so it outlives any of them, as torchrun's agent store does.
    """
    from torch._C._distributed_c10d import TCPStore

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = int(sock.getsockname()[1])
    # detach(): the store's server owns the descriptor from now on (Python must not close it).
    store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                     wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


# glibc's malloc, told to keep what a rank frees: no block is mapped on its own or handed back
# to the system. By default glibc maps a large block (a layer's gradient) fresh whenever no
# larger one was freed before in the process, and every use then faults its pages in again: a
# zero-bubble W pass on 1024-wide layers took 6-14 ms instead of 4-6 (docs/benchmarks.md).
# A training rank's memory comes back to the same peak every step, so nothing is lost by
# keeping it; other C libraries ignore these variables.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def _allocator_env() -> dict[str, str]:
    """`ALLOCATOR`, unless the user set either variable (then neither is touched)."""
    return {} if any(k in os.environ for k in ALLOCATOR) else dict(ALLOCATOR)


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    env.update(_allocator_env())
    return env


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
           results: Any, timeout: float, backend: str) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        if backend == "gloo":
            # Every rank has joined before any runs `fn`. gloo connects the ranks pairwise in
            # init_process_group, and a rank can return from it before its peers do: if `fn`
            # then returned at once and the rank exited, it closed pairs a slower rank was
            # still setting up ("Gloo connectFullMesh failed ... Connection closed by peer").
            dist.barrier()
        results.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # reported to the parent, which raises RankFailed
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _drain(results: Any, got: dict[int, tuple[str, Any]]) -> None:
    """Read every report already in `results` into `got`, without waiting."""
    while True:
        try:
            rank, status, value = results.get(block=False)
        except queue.Empty:
            return
        got[rank] = (status, value)


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float = 120.0,
          backend: str = "gloo", grace: float = GRACE_S) -> list[Any]:
    """Run `fn(rank, *args)` on `nproc` fresh ranks (gloo; or NCCL, rank r on cuda:r); return
    each rank's result in order.

    `fn` must be importable (a module-level function). Raises `RankFailed` naming every rank
    that raised, died, or did not finish within `timeout` seconds; once one rank has raised
    or died, the others get `grace` seconds to finish (or report) and are then stopped.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store, port = host_store()
    procs = [ctx.Process(target=_child, args=(fn, r, nproc, port, args, results, timeout, backend),
                         daemon=True) for r in range(nproc)]
    # The allocator reads its variables when the process starts: set them around the starts.
    allocator = _allocator_env()
    os.environ.update(allocator)
    try:
        for p in procs:
            p.start()
    finally:
        for key in allocator:
            del os.environ[key]
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(got) < nproc and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
            got[rank] = (status, value)
        except queue.Empty:
            exited = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            # A rank reports, then exits: its report can reach the queue just after the get
            # above gave up. Once a rank has exited its report is in the queue (a child's
            # queue is flushed at exit), so read what is there before calling any rank dead.
            _drain(results, got)
            for r in exited:
                if r not in got:  # exited without reporting: killed, or crashed hard
                    code = procs[r].exitcode
                    assert code is not None
                    how = f"; it {describe_exit(code)}" if code < 0 else ""
                    got[r] = ("error", f"process died (exit code {code}){how}")
        failed = [r for r, (status, _) in got.items() if status == "error"]
        if failed and deadline > time.monotonic() + grace:
            _log.info("rank %d failed; the others get %gs to finish", failed[0], grace)
            deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    missing = [r for r in range(nproc) if r not in got]
    errors = {r: v for r, (status, v) in got.items() if status == "error"}
    if errors or missing:
        lines = [f"rank {r}: {errors[r]}" for r in sorted(errors)]
        lines += [f"rank {r}: no result within {timeout:.0f}s" for r in missing]
        ok = {r: v for r, (status, v) in got.items() if status == "ok"}
        raise RankFailed("\n".join(lines), ok)
    del store  # served the ranks until here
    return [got[r][1] for r in range(nproc)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.launch",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start (>= 1)")
    parser.add_argument("--grace", type=settings.flag("--grace", low=0, high=86400,
                                                      unit=" seconds"), default=GRACE_S,
                        help="seconds the other ranks get to exit after one fails "
                             "(default: %(default)g)")
    parser.add_argument("--init-timeout", default=300.0,
                        type=settings.flag("--init-timeout", low=0.001, high=MAX_INIT_TIMEOUT,
                                           unit=" seconds"),
                        help=f"seconds a rank waits for the others to join the process group "
                             f"(sets {INIT_TIMEOUT_ENV}; Pipe reads it) (default: %(default)g)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="replica groups of --nproc ranks each, under torchft (needs the "
                             "[ft] extra; the script builds Pipe(..., fault_tolerance=True)) "
                             "(default: none: one group of --nproc ranks, no torchft)")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="with --replicas: restarts allowed per replica group "
                             "(default: %(default)s)")
    parser.add_argument("--spares", type=int, default=0,
                        help="with --replicas: spare groups of --nproc ranks that start, build "
                             "their Pipe and wait, and take a lost group's place at once (no "
                             "start, no import, no build; each holds a full group's memory "
                             "while it waits) (default: %(default)s)")
    parser.add_argument("--heartbeat-timeout", default=None,
                        type=settings.flag("--heartbeat-timeout", low=0.001, high=86400,
                                           unit=" seconds"),
                        help="with --replicas: seconds without a heartbeat after which the "
                             "lighthouse drops a replica group (default 5, torchft's; shorter "
                             "detects a lost group sooner on a quiet host)")
    parser.add_argument("--progress-timeout", default=None,
                        type=settings.flag("--progress-timeout", low=0.001, high=10**7,
                                           unit=" seconds"),
                        help="with --replicas: seconds a live replica group may go without "
                             "committing a step before the job ends with an error, not "
                             "retried forever (default 600)")
    parser.add_argument("--private-network", action="store_true",
                        help="run the job in a network namespace of its own: its loopback "
                             "servers (stores, gloo, the lighthouse and managers) out "
                             "of other local users' reach, and no other network "
                             "(docs/security.md)")
    parser.add_argument("script", help="the training script each rank runs, as `python "
                                        "script ARGS` (a path; it must exist)")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="arguments passed on to the script, as they are")
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error(f"--nproc must be >= 1 (got {ns.nproc})")
    missing = _missing(ns.script)
    if missing:  # before any rank, group or namespace starts: each would fail alike
        parser.error(missing)
    if ns.private_network:  # inside only by the mark of the launcher outside, never a variable
        try:
            started_inside = private_net.inside()
        except private_net.NotPrivate as exc:
            print(f"pipeline.launch: --private-network: {exc}; not starting the job",
                  file=sys.stderr)
            return 1
        if not started_inside:
            return exit_status(private_net.relaunch(sys.argv[1:] if argv is None else argv))
    if ns.spares and ns.replicas is None:
        parser.error(f"--spares {ns.spares} needs --replicas (spares take a lost replica "
                     f"group's place): add --replicas R, or drop --spares")
    extra = {INIT_TIMEOUT_ENV: str(ns.init_timeout)}
    if ns.replicas is not None:
        from pipeline.errors import PipeConfigError
        from pipeline.replicas.launch import run_replicas

        try:
            return run_replicas(ns.script, ns.args, replicas=ns.replicas, nproc=ns.nproc,
                                max_restarts=ns.max_restarts, init_timeout_env=extra,
                                heartbeat_timeout=ns.heartbeat_timeout,
                                progress_timeout=ns.progress_timeout, spares=ns.spares)
        except PipeConfigError as exc:
            parser.error(str(exc))
    store, port = host_store()
    # A signal to the launcher (a scheduler's SIGTERM, Ctrl-C) goes on to every rank, and the
    # launcher waits for them as for a failure: no rank outlives it.
    stopping: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    procs = [subprocess.Popen([sys.executable, ns.script, *ns.args],
                              env={**os.environ, **rank_env(r, ns.nproc, port), **extra})
             for r in range(ns.nproc)]
    _log.info("started %d ranks; rendezvous store on 127.0.0.1:%d", ns.nproc, port)
    try:
        code = _watch(procs, ns.grace, stopping)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    del store  # served the ranks until they all exited
    return exit_status(code or next((p.returncode for p in procs if p.returncode), 0))


def _missing(script: str) -> str:
    """Why `python script` cannot run it, or "": a path that is not there, or a directory
    without the __main__.py Python would run."""
    if not os.path.exists(script):
        return (f"script {script!r} does not exist (from {os.getcwd()!r}): give the path of "
                f"the training script every rank runs")
    if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        return (f"script {script!r} is a directory without __main__.py: give the path of the "
                f"training script every rank runs")
    return ""


def _watch(procs: list[subprocess.Popen[bytes]], grace: float, stopping: list[int]) -> int:
    """Wait for every rank; after a failure (or a signal to the launcher, passed on to each
    rank) the others get `grace` seconds, then are killed. The first failure's code, 128 +
    the signal for a signal to the launcher."""
    failed_at: float | None = None
    code = 0
    while any(p.poll() is None for p in procs):
        if stopping and failed_at is None:
            failed_at, code = time.monotonic(), -stopping[0]
            print(f"pipeline.launch: stopped by {signal.Signals(stopping[0]).name}; passed on "
                  f"to every rank, which get {grace:g}s", file=sys.stderr)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(stopping[0])
        for r, p in enumerate(procs):
            if p.poll() not in (None, 0) and failed_at is None:
                failed_at, code = time.monotonic(), p.returncode
                print(f"pipeline.launch: rank {r} {describe_exit(p.returncode)}; the others "
                      f"get {grace:g}s", file=sys.stderr)
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    _log.warning("stopping rank %d (still running %gs after a failure)", r,
                                 grace)
                    p.kill()
        time.sleep(0.1)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
