"""pipeline/comm/handed.py: after a collective, the backend holds none of its tensors."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from pipeline.comm.handed import Handed, handed


@pytest.fixture
def group() -> Iterator[object]:
    """A one-rank gloo group of this process alone (no default group): its collectives still
    run on gloo's worker threads, which is what matters here. The case `handed` waits for is
    a worker that still holds the tensor when `wait()` returns; left to the scheduler it came
    in a few of 300 collectives under load, and on an idle machine in none (the tests
    skipped). So the worker threads share this thread's CPU at the lowest priority: the
    worker that wakes this thread at a collective's end is preempted by it at once, before
    it lets go, and the case comes in nearly every collective, on any machine."""
    from torch._C._distributed_c10d import HashStore, ProcessGroupGloo

    tasks = Path("/proc/self/task")
    if not hasattr(os, "sched_setaffinity") or not tasks.is_dir():
        pytest.skip("needs Linux's per-thread CPU affinity and priority")
    affinity = os.sched_getaffinity(0)  # this thread's, restored below
    cpu = min(affinity)
    before = set(os.listdir(tasks))
    os.sched_setaffinity(0, {cpu})  # threads started now inherit it
    try:
        pg = ProcessGroupGloo(HashStore(), 0, 1, timedelta(seconds=60))
        workers = [int(t) for t in set(os.listdir(tasks)) - before]
        assert workers, "the group started no thread"
        for tid in workers:
            os.sched_setaffinity(tid, {cpu})
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        yield pg
        del pg  # its threads end with it
    finally:
        os.sched_setaffinity(0, affinity)


def test_a_collectives_tensor_is_let_go_before_handed_returns(group: object) -> None:
    held_after_wait = 0  # collectives whose worker still held the tensor after `wait()`
    late = []
    for i in range(300):
        t = torch.randn(64)
        with handed(t):
            work = group.allreduce([t])  # type: ignore[attr-defined]
            work.wait()
            del work
            held_after_wait += t._use_count() > 1  # type: ignore[attr-defined]
        if t._use_count() != 1:  # type: ignore[attr-defined]
            late.append(i)
    assert not late, f"the backend still held the tensor after {len(late)} of 300 collectives"
    # Else the test checked nothing: the fixture makes it come in nearly every collective.
    assert held_after_wait > 0, "gloo let go before every check: the case never came"


def test_an_async_work_is_let_go_once_its_reference_is_dropped(group: object) -> None:
    held_after_wait = 0
    for _ in range(100):
        t = torch.randn(64)
        held = Handed([t])
        work = group.allreduce([t])  # type: ignore[attr-defined]
        work.wait()
        del work  # as GradSync drops a bucket's work before settling it
        held_after_wait += t._use_count() > 1  # type: ignore[attr-defined]
        held.settle()
        assert t._use_count() == 1  # type: ignore[attr-defined]
    assert held_after_wait > 0, "gloo let go before every check: the case never came"


def test_a_reference_taken_elsewhere_ends_the_wait_at_its_timeout(
        caplog: pytest.LogCaptureFixture) -> None:
    t = torch.randn(8)
    held = Handed([t])
    view = t[2:]  # a view holds its base: the count stays above the one taken before
    with caplog.at_level(logging.WARNING, logger="pipeline.comm.handed"):
        held.settle(timeout=0.05)
    assert "still held" in caplog.text
    del view


def test_a_collective_that_raised_is_not_waited_for() -> None:
    t = torch.randn(8)
    keep = t[1:]  # would make a settle wait for its whole timeout
    with pytest.raises(RuntimeError, match="broken"), handed(t):
        raise RuntimeError("broken group")
    del keep
