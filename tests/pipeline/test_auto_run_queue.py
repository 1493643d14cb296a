"""`schedule="auto"` takes the time each timed action's thread waited on a CPU's run queue off
its wall time (pipeline/schedstat.py, pipeline/auto_schedule.py): in `stage_costs`, in what the
profiled step records (a fake schedstat reader, and a fake /proc), and end to end on one CPU
shared with spinning processes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import nn

from benchmarks.auto_schedule import stage_costs as nominal_costs
from benchmarks.auto_sleep import runtime_costs, sleep_model
from pipeline import Pipe
from pipeline.auto_schedule import stage_costs
from pipeline.schedstat import ThreadWait
from schedules import Action, Costs, Event, Op
from tests.busy import busy_cores

_COMPUTE = (Op.F, Op.I, Op.W)
WAIT_NS = 4_000_000  # what the fake reader adds to the acting thread's wait at each sleep


def _ev(stage: int, op: Op, m: int, seconds: float) -> Event:
    return Event(stage, Action(stage, op, m), 1.0, 1.0 + seconds)


def test_stage_costs_take_each_actions_run_queue_wait_off_its_wall_time() -> None:
    events = [_ev(0, Op.F, 0, 0.010), _ev(0, Op.F, 1, 0.012), _ev(0, Op.F, 2, 0.030),
              _ev(0, Op.I, 0, 0.020), _ev(0, Op.W, 0, 0.005),
              _ev(1, Op.F, 0, 0.004), _ev(1, Op.B, 0, 0.040)]
    waited = {(0, Action(0, Op.F, 0)): 0.004, (0, Action(0, Op.F, 1)): 0.002,
              (0, Action(0, Op.F, 2)): 0.020, (0, Action(0, Op.I, 0)): 0.015,
              (0, Action(0, Op.W, 0)): 0.009,  # more than its wall time: the floor
              (1, Action(1, Op.B, 0)): 0.010}
    assert stage_costs(events, [0, 1], waited) == {0: (0.01, 0.005, 1e-6),
                                                   1: (0.004, 0.015, 0.015)}
    assert stage_costs(events, [0, 1]) == {0: (0.012, 0.02, 0.005), 1: (0.004, 0.02, 0.02)}


class FakeWaits:
    """A schedstat reader keyed by the calling thread: each thread's nanoseconds waited, which
    the sleep model's log raises by WAIT_NS at every sleep (on the thread that sleeps), having
    slept that long: a wait for a CPU as the wall clock sees it."""

    def __init__(self) -> None:
        self.ns: dict[int, int] = {}
        self.reads = 0

    def __call__(self) -> int | None:
        self.reads += 1
        return self.ns.get(threading.get_native_id(), 0)

    def log(self, label: str, kind: str) -> None:
        time.sleep(WAIT_NS / 1e9)
        tid = threading.get_native_id()
        self.ns[tid] = self.ns.get(tid, 0) + WAIT_NS


def test_the_profiled_step_records_each_compute_actions_run_queue_wait() -> None:
    fake = FakeWaits()
    model, balance = sleep_model([2, 0], head=1.0, head_w=1.0, unit=1e-4, log=fake.log)
    pipe = Pipe(model, balance, devices=["cpu"] * 2, chunks=4, schedule="auto",
                checkpoint="never")
    assert pipe.auto is not None
    pipe.auto.thread_wait = fake
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x, y, nn.MSELoss())
    runtimes = pipe._executor.runtimes
    for rt in runtimes:
        assert len(rt.queued) == len(rt.events)
        for e, q in zip(rt.events, rt.queued, strict=True):
            # Stage 0: the embedding and two blocks; stage 1: the head. Each F sleeps once per
            # layer, I once per layer with an I sleep, W once per layer (stage 0's I computes
            # nothing: its W runs the whole backward, every sleep of it).
            count = {(0, Op.F): 3, (0, Op.I): 0, (0, Op.W): 3 + 2,
                     (1, Op.F): 1, (1, Op.I): 1, (1, Op.W): 1}[(e.action.stage, e.action.op)]
            assert q == pytest.approx(count * WAIT_NS / 1e9), e
    costs = pipe.auto.costs
    assert costs is not None
    wall = stage_costs(pipe.last_timeline().events, [0, 1])
    # What auto synthesised for: the wall medians less the waits (each F of stage 0: 3 waits,
    # of the head's stage 1), which the wall times hold and the sleeps (0.25 ms) are not near.
    assert wall[0][0] > 3 * WAIT_NS / 1e9 and wall[1][0] > WAIT_NS / 1e9
    assert costs.of(Op.F, 0) == pytest.approx(wall[0][0] - 3 * WAIT_NS / 1e9, abs=2e-6)
    assert costs.of(Op.F, 1) == pytest.approx(wall[1][0] - WAIT_NS / 1e9, abs=2e-6)
    assert costs.of(Op.W, 0) == pytest.approx(wall[0][2] - 5 * WAIT_NS / 1e9, abs=2e-6)
    reads = fake.reads
    pipe.step(x, y, nn.MSELoss())  # only the profiled step reads
    assert fake.reads == reads and all(not rt.queued for rt in runtimes)
    pipe.close()


def test_thread_wait_reads_the_calling_threads_schedstat_and_notes_once_where_none(
        tmp_path: Path) -> None:
    task = tmp_path / str(os.getpid()) / "task" / str(threading.get_native_id())
    task.mkdir(parents=True)
    (task / "schedstat").write_text("123456 7890 12\n")
    notes: list[str] = []
    read = ThreadWait(tmp_path, note=notes.append)
    assert read() == 7890 and notes == []
    (task / "schedstat").write_text("123456 9000 13\n")
    assert read() == 9000
    (task / "schedstat").unlink()  # a kernel without CONFIG_SCHED_INFO
    assert read() is None and read() is None
    assert len(notes) == 1 and "schedstat" in notes[0] and "CONFIG_SCHED_INFO" in notes[0]
    assert "wall time" in notes[0]


def test_on_one_cpu_shared_with_spinners_auto_measures_the_sleeps_not_the_waits() -> None:
    """The Pipe's threads pinned to one CPU beside three spinning processes pinned there: every
    sleep's end and every bit of host work waits on that CPU's run queue, so the wall times of
    the sleep-cost stages are far above their sleeps, while auto's costs (the waits taken off)
    stay near them (above by the runtime's own host time only)."""
    if not Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat").exists():
        pytest.skip("this kernel keeps no run-queue waits (no /proc/<pid>/task/<tid>/schedstat)")
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no os.sched_setaffinity here: the test cannot share one CPU")
    unit, blocks = 0.004, [2, 1]
    sleeps = runtime_costs(nominal_costs(blocks, head=1.0, head_w=1.0, comm=0.0), 2)
    cpu = min(os.sched_getaffinity(0))
    out: dict[str, object] = {}

    def profile() -> None:
        # On a thread of its own, whose affinity and niceness the Pipe's threads inherit and
        # the test process's other threads keep: pinned to the spinners' CPU, and at nice 10
        # (weight 110 against the spinners' 3 x 1024), so that its wakes wait on the run queue
        # every time; at nice 0 a waking sleeper is often let in at once, and the wall times
        # came out close to the sleeps in one run of several.
        try:
            os.sched_setaffinity(0, {cpu})
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            model, balance = sleep_model(blocks, head=1.0, head_w=1.0, unit=unit)
            pipe = Pipe(model, balance, devices=["cpu"] * 2, chunks=4, schedule="auto",
                        checkpoint="never")
            try:
                pipe.step(torch.randn(8, 8), torch.randn(8, 8), nn.MSELoss())
                out["wall"] = stage_costs(pipe.last_timeline().events, [0, 1])
                assert pipe.auto is not None and pipe.auto.costs is not None
                out["costs"] = pipe.auto.costs
            finally:
                pipe.close()
        except BaseException as exc:  # re-raised on the test's thread
            out["error"] = exc

    with busy_cores(3) as spinners:
        for spinner in spinners:
            os.sched_setaffinity(spinner.pid, {cpu})
        worker = threading.Thread(target=profile, name="pinned-profile")
        worker.start()
        worker.join()
    if "error" in out:
        raise cast(BaseException, out["error"])
    wall = cast(dict[int, tuple[float, float, float]], out["wall"])
    costs = cast(Costs, out["costs"])
    for s in (0, 1):
        slept = sum(sleeps.of(op, s) * unit for op in _COMPUTE)
        measured = sum(costs.of(op, s) for op in _COMPUTE)
        assert slept * 0.95 < measured < slept * 1.35, (s, measured, slept)
        assert sum(wall[s]) > slept * 1.5, (s, wall[s], slept)  # what main measured
