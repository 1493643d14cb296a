"""Failures in one process: once a rank fails, the others stop working on the failed step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe, PipelineError


class _Count(nn.Module):
    """Counts its forwards; from micro-batch 1 on, says so and waits until the step has
    failed."""

    def __init__(self, computing: threading.Event, failed: threading.Event) -> None:
        super().__init__()
        self.computing, self.failed = computing, failed
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            self.computing.set()
            assert self.failed.wait(50)
        return x


class _Raise(nn.Module):
    """Fails once `ready()` holds (the test's events order the ranks, however slow each is)."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        super().__init__()
        self.ready = ready

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deadline = time.monotonic() + 50
        while not self.ready():
            assert time.monotonic() < deadline, "the other ranks never got there"
            time.sleep(0.01)
        raise ValueError("bad stage")


@pytest.mark.timeout(60)
def test_after_a_failure_no_rank_computes_micro_batches_already_delivered() -> None:
    computing, failed = threading.Event(), threading.Event()
    count = _Count(computing, failed)
    transport: Any = None

    def ready() -> bool:
        # Rank 1 is computing micro-batch 1 and micro-batches 2 and 3 wait in its mailbox.
        with transport._cond:
            delivered = set(transport._box)
        return computing.is_set() and {("F", 1, 2), ("F", 1, 3)} <= delivered

    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), count, _Raise(ready)), [1, 1, 1], chunks=4,
                schedule="gpipe", timeout=60)
    transport = pipe._executor.transport
    abort = transport.abort

    def abort_and_tell(rank: int, message: str) -> None:
        abort(rank, message)
        failed.set()

    transport.abort = abort_and_tell
    with pytest.raises(PipelineError, match=r"rank 2 \(cpu\) failed at 2F0 .*bad stage"):
        pipe.step(torch.randn(8, 4), torch.randn(8, 4), nn.MSELoss())
    # Rank 1 was computing micro-batch 1 when rank 2 failed; micro-batches 2 and 3 had
    # arrived but must not run.
    assert count.calls == 2
