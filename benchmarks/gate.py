"""The start of a measured step: a barrier, then the step's processes start together, once every
process of the group is through it, and none of them is still busy with the step before.

A `multiprocessing.Barrier` releases its waiters one by one: the last to arrive wakes each
sleeper and waits until it has woken. With five processes on a small machine the last one
leaves a millisecond or more after the first, and which process arrives last depends on the
variant before (the plain model on every thread arrives after its step, for one). A step
timed from each process's own exit would charge that stagger, and the wake-ups of the
processes sitting the step out, to whichever variant follows: the same variant, round after
round. So the processes that take the step wait, yielding their CPU, until every process has
left the barrier, then a moment more for those sitting out to go back to sleep; the clock
starts after that, on every process of the step at once.

A process can also stay busy after its step: OpenMP's worker threads spin for milliseconds
after a parallel region (the plain model on every thread), taking a CPU from the next
variant's processes. Each process that took a step waits, before the next barrier, until its
threads are quiet (`quiet`).
"""

from __future__ import annotations

import os
import resource
import time
from multiprocessing.context import BaseContext
from typing import Any

__all__ = ["QUIET", "SETTLE", "StartGate", "quiet"]

SETTLE = 200e-6  # seconds for the processes sitting a step out to be asleep again
# A process is quiet when it used under a fifth of this much CPU in this much time. Another
# thread's CPU time is counted at the scheduler's ticks (4 ms apart here): a shorter window
# would see a spinning thread as idle between two ticks.
QUIET = 5e-3


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def quiet(limit: float = 0.2) -> float:
    """Sleep until this process's threads stop using the CPU (at most `limit` seconds); the
    seconds it took."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        used = _cpu_seconds()
        time.sleep(QUIET)
        if _cpu_seconds() - used < QUIET / 5:
            break
    return time.perf_counter() - start


class StartGate:
    """A barrier for `parties` processes, and the aligned start of a step on top of it.

    Made in the parent (`StartGate(ctx, n)`) and handed to the spawned processes. `wait` is a
    plain barrier; `start(taking)` is the barrier before a step: it returns on the processes
    that take the step (`taking`) only when all `parties` have passed it. Every process calls
    `start` the same number of times.
    """

    def __init__(self, ctx: BaseContext, parties: int) -> None:
        self.parties = parties
        self._barrier = ctx.Barrier(parties)
        self._passed = ctx.Value("q", 0)  # processes through `start`, over every call
        self._calls = 0  # this process's calls of `start` (not shared)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_calls": 0}

    def wait(self, timeout: float) -> None:
        self._barrier.wait(timeout)

    def abort(self) -> None:
        self._barrier.abort()

    def start(self, taking: bool, timeout: float) -> None:
        self._barrier.wait(timeout)
        self._pass()
        if taking:
            self._await_everyone(timeout)

    def _pass(self) -> None:
        self._calls += 1
        with self._passed.get_lock():
            self._passed.value += 1

    def _await_everyone(self, timeout: float) -> None:
        everyone = self.parties * self._calls
        deadline = time.monotonic() + timeout
        while self._passed.value < everyone:
            if self._barrier.broken:
                raise RuntimeError("a process of the group failed before this step started")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other processes did not pass the start within "
                                   f"{timeout:g} s")
            os.sched_yield()  # their wake-ups need the CPU
        settled = time.perf_counter() + SETTLE
        while time.perf_counter() < settled:
            os.sched_yield()
