"""pipeline.runtime.gpu_clock: a rank's actions take the GPU's times (CUDA events faked)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.runtime.gpu_clock import GpuClock
from schedules import Action, Event


class _FakeEvent:
    """A CUDA event on a fake GPU whose clock (milliseconds) the test sets."""

    now: ClassVar[float] = 0.0
    synced: ClassVar[list[_FakeEvent]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        assert stream == "stream of cuda:1"  # the rank's device's, not the thread's current
        self.at = _FakeEvent.now

    def synchronize(self) -> None:
        _FakeEvent.synced.append(self)

    def elapsed_time(self, other: Any) -> float:
        assert self.at is not None and other.at is not None
        return other.at - self.at


def test_actions_take_the_gpus_times_from_the_reference_on(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The run begins at host 0.5 s (GPU 100 ms). An action whose launches the host saw in
    1 ms had its input 150 ms after the reference (marked again after a peer's) and ended
    at 700 ms on the GPU: it is placed at 0.65-1.2 s. An action not marked (a message's)
    keeps the host's times; the last mark is waited for, once."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    _FakeEvent.synced = []
    clock = GpuClock(torch.device("cuda", 1))
    _FakeEvent.now = 100.0
    clock.begin(0.5)
    host = [Event(0, Action.parse("0F0"), 0.51, 0.511), Event(0, Action.parse("0SEND_F0"),
                                                               0.512, 0.513),
            Event(0, Action.parse("0B0"), 0.52, 0.521)]
    _FakeEvent.now = 300.0
    clock.ready()
    _FakeEvent.now = 250.0  # a wait for a peer's input: the start is marked again
    clock.ready()
    _FakeEvent.now = 800.0
    clock.done(0)
    _FakeEvent.now = 810.0
    clock.ready()
    _FakeEvent.now = 900.0
    clock.done(2)
    timed = clock.resolver(host)
    assert _FakeEvent.synced == []  # nothing waits for the GPU until the times are read
    clock.begin(1.5)  # the next run marks anew; the last one's times stay readable
    _FakeEvent.now = 2000.0
    clock.ready()
    clock.done(0)
    got = timed()
    assert [(e.start, e.end) for e in got] == [
        (pytest.approx(0.65), pytest.approx(1.2)), (0.512, 0.513),
        (pytest.approx(1.21), pytest.approx(1.3))]
    assert [str(e.action) for e in got] == ["0F0", "0SEND_F0", "0B0"]
    assert len(_FakeEvent.synced) == 1


def test_a_run_with_no_mark_is_left_as_the_host_saw_it() -> None:
    host = [Event(0, Action.parse("0F0"), 0.1, 0.2)]
    assert GpuClock(torch.device("cuda", 0)).resolver(host)() == host


def test_a_step_waits_for_no_gpu_mark_until_its_timeline_is_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank of a Pipe marks its actions on a (faked) GPU: the steps return without
    waiting for a mark, the timeline read after them waits once per rank for the last step's
    marks alone, and reading it again waits for nothing more."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    _FakeEvent.synced = []
    pipe = Pipe(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)), [2, 1],
                devices=["cpu", "cpu"], chunks=2)
    try:
        for rt in pipe._executor.runtimes:
            rt.gpu_clock = GpuClock(torch.device("cuda", 1))
        for _ in range(3):
            pipe.step(torch.randn(4, 3), torch.randn(4, 2), nn.MSELoss())
        assert _FakeEvent.synced == []
        events = pipe.last_timeline().events
        assert len(_FakeEvent.synced) == 2  # one per rank
        assert len(events) == 2 * 2 * 2  # F and B of 2 micro-batches on each of 2 stages
        assert pipe.last_timeline().events == events and len(_FakeEvent.synced) == 2
    finally:
        pipe.close()
