"""Persistent rank workers: one thread per rank for the life of a Pipe, fed one step at a time."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["RankWorkers"]

_Job = tuple[Callable[[], None], threading.Event] | None


def _serve(jobs: queue.SimpleQueue[_Job], device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # once: every kernel this thread launches goes there
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, done = job
        try:
            fn()  # reports its own errors; see Executor
        finally:
            done.set()


class RankWorkers:
    """Daemon threads, one per rank, each bound to its device.

    `run` hands every rank its job for one step and waits for all of them. `close` (also called
    when the owning Pipe is collected, or at interpreter exit) stops the threads; the workers
    hold no reference to the Pipe, so they never keep it alive.
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self._queues: list[queue.SimpleQueue[_Job]] = [queue.SimpleQueue() for _ in devices]
        self.threads = [threading.Thread(target=_serve, args=(q, d), daemon=True,
                                         name=f"pipe-rank-{r}")
                        for r, (q, d) in enumerate(zip(self._queues, devices, strict=True))]
        for t in self.threads:
            t.start()
        self.closed = False

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

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for q in self._queues:
            q.put(None)
