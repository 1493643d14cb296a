"""benchmarks.gate: a step starts once every process is through the barrier, on quiet processes."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import pytest
import torch

from benchmarks.gate import StartGate, quiet

_LATE = 0.3  # seconds the process sitting the step out takes to leave the barrier


def _sits_out_slowly(gate: StartGate, out: Any) -> None:
    # A process that leaves the barrier late (woken last by it), then passes.
    gate._barrier.wait(30)
    time.sleep(_LATE)
    out.put(("passed", time.monotonic()))
    gate._pass()


def _takes_the_step(gate: StartGate, out: Any) -> None:
    gate.start(True, 30)
    out.put(("started", time.monotonic()))


def test_a_step_starts_only_once_every_process_has_left_the_barrier() -> None:
    ctx = mp.get_context("spawn")
    gate, out = StartGate(ctx, 2), ctx.Queue()
    procs = [ctx.Process(target=_sits_out_slowly, args=(gate, out)),
             ctx.Process(target=_takes_the_step, args=(gate, out))]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert got["started"] >= got["passed"]  # not at its own exit from the barrier


def test_a_failed_process_ends_the_wait_for_it() -> None:
    ctx = mp.get_context("spawn")
    gate = StartGate(ctx, 3)
    # Two of three passed the start, then the group broke: the taker must not wait for ever.
    gate._calls, gate._passed.value = 1, 2
    gate.abort()
    with pytest.raises(RuntimeError, match="failed before this step started"):
        gate._await_everyone(30)


def test_quiet_waits_for_the_processs_busy_threads_and_not_when_idle() -> None:
    # Nothing runs: it returns after a window or a few, well before its limit (a loaded
    # machine can stretch a 5 ms sleep; only hitting the limit would mean it waited).
    assert quiet(limit=1.0) < 0.5
    stop = time.monotonic() + 0.15

    def burn() -> None:  # a thread using a CPU outside the GIL, as OpenMP's workers do
        x = torch.randn(256, 256)
        while time.monotonic() < stop:
            x @ x

    worker = threading.Thread(target=burn)
    worker.start()
    took = quiet(limit=1.0)
    worker.join()
    assert took >= 0.1
