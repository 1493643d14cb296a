"""Failures in one process: once a rank fails, the others stop working on the failed step."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe, PipelineError


class _Count(nn.Module):
    """Counts its forwards; from micro-batch 1 on, waits until the step has failed."""

    def __init__(self, failed: threading.Event) -> None:
        super().__init__()
        self.failed = failed
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            assert self.failed.wait(10)
        return x


class _Raise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad stage")


@pytest.mark.timeout(60)
def test_after_a_failure_no_rank_computes_micro_batches_already_delivered() -> None:
    failed = threading.Event()
    count = _Count(failed)
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), count, _Raise()), [1, 1, 1], chunks=4,
                schedule="gpipe", timeout=20)
    transport: Any = pipe._executor.transport
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
