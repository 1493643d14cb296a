"""benchmarks.gate: a step starts once every process is through the barrier, on quiet processes."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

from benchmarks import gate
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


def test_quiet_returns_at_once_when_nothing_runs() -> None:
    # A loaded machine can stretch a 5 ms sleep; only hitting the limit would mean it waited.
    assert quiet(limit=1.0) < 0.5


def _cpu_clock(busy_windows: int) -> Any:
    """A process CPU clock (gate._cpu_seconds) that uses a whole CPU in each of the first
    `busy_windows` windows `quiet` watches, then none: the reads come in pairs, one before
    and one after each window's sleep."""
    reads = {"n": 0, "total": 0.0}

    def seconds() -> float:
        if reads["n"] % 2 and reads["n"] // 2 < busy_windows:
            reads["total"] += gate.QUIET
        reads["n"] += 1
        return reads["total"]
    return seconds, reads


def test_quiet_waits_while_the_processs_threads_use_a_cpu(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Its rule, on a CPU clock the test sets (how busy a real thread keeps a CPU depends on
    the machine's load, so a burning thread would test the machine, not the rule): it sleeps
    window after window while the process used a CPU in the last one, and returns in the
    first idle window; busy throughout, it returns at its limit."""
    seconds, reads = _cpu_clock(4)
    monkeypatch.setattr(gate, "_cpu_seconds", seconds)
    took = quiet(limit=1.0)
    assert reads["n"] == 2 * 5  # four busy windows, then the idle one
    assert took >= 5 * gate.QUIET
    seconds, reads = _cpu_clock(10**6)
    monkeypatch.setattr(gate, "_cpu_seconds", seconds)
    assert quiet(limit=0.05) >= 0.05
