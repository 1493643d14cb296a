"""Persistent rank workers: one thread per rank for the life of a Pipe, fed one step at a time."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

__all__ = ["RankWorkers", "close_all"]

_Job = tuple[Callable[[], None], threading.Event] | None
# Every open set of workers, so interpreter exit can stop and join them (see `close_all`).
_OPEN: weakref.WeakSet[RankWorkers] = weakref.WeakSet()
_log = logging.getLogger(__name__)
_JOIN_SECONDS = 10.0  # a rank busy longer than this at exit is left to the interpreter


def _serve(jobs: queue.SimpleQueue[_Job], device: torch.device) -> None:
    if device.type == "cuda":
        try:
            torch.cuda.set_device(device)  # once: every kernel this thread launches goes there
        except (RuntimeError, ValueError) as exc:
            # Never die here: the caller would wait for this rank's jobs forever. Its tensors
            # are placed on `device` explicitly, so its kernels still run there.
            _log.warning("rank thread for %s could not bind to it: %s", device, exc)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, done = job
        del job
        try:
            fn()  # reports its own errors; see Executor
        finally:
            # Drop the step's closure (and the tensors it holds) here, before the caller
            # hears the step is done: otherwise this thread frees them at its next wake-up,
            # which at interpreter exit races with finalisation (SIGABRT in torch's C++).
            del fn
            done.set()


class RankWorkers:
    """Daemon threads, one per rank, each bound to its device.

    `run` hands every rank its job for one step and waits for all of them. `close` (also called
    when the owning Pipe is collected, and at interpreter exit) stops the threads and joins
    them; the workers hold no reference to the Pipe, so they never keep it alive.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self._queues: list[queue.SimpleQueue[_Job]] = [queue.SimpleQueue() for _ in devices]
        self.threads = [threading.Thread(target=_serve, args=(q, d), daemon=True,
                                         name=f"pipe-rank-{r}")
                        for r, (q, d) in enumerate(zip(self._queues, devices, strict=True))]
        for t in self.threads:
            t.start()
        self.closed = False
        _OPEN.add(self)

    def run(self, jobs: Sequence[Callable[[], None]], *, failed: Callable[[], bool],
            grace: float) -> list[int]:
        """Run `jobs[r]` on rank r's thread; wait until all finish. Once `failed()` is true,
        ranks get `grace` seconds more to finish; return the ranks that did not (stuck)."""
        if self.closed:
            raise RuntimeError("the rank workers were closed")
        dones = [threading.Event() for _ in jobs]
        for q, job, done in zip(self._queues, jobs, dones, strict=True):
            q.put((job, done))
        give_up: float | None = None
        for done in dones:
            while not done.wait(0.1):
                if give_up is None and failed():
                    give_up = time.monotonic() + grace
                if give_up is not None and time.monotonic() > give_up:
                    return [r for r, d in enumerate(dones) if not d.is_set()]
        return []

    def close(self, *, wait: bool = True) -> None:
        """Stop the threads; with `wait`, join them (a rank still inside a step gets up to
        `_JOIN_SECONDS`). `wait=False` is for threads abandoned after a failure."""
        if not self.closed:
            self.closed = True
            _OPEN.discard(self)
            for q in self._queues:
                q.put(None)
        if wait:
            deadline = time.monotonic() + _JOIN_SECONDS
            for t in self.threads:
                if t is not threading.current_thread():
                    t.join(max(0.0, deadline - time.monotonic()))


@atexit.register
def close_all() -> None:
    """Stop and join every open set of workers (at exit, and before a group is destroyed)."""
    # Daemon threads still running when the interpreter finalises can free tensors (and run
    # torch's C++ destructors) while it tears down: stop and join them first.
    for workers in list(_OPEN):
        workers.close()
