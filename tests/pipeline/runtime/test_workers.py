"""Persistent rank workers: made once per Pipe, reused every step, stopped by close() or GC."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch import nn

from pipeline import Pipe, PipelineError
from pipeline.runtime.workers import RankWorkers


def _pipe_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("pipe-rank-")}


def _wait_gone(threads: set[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1", "2bw"])
def test_a_step_creates_no_threads_after_the_first(schedule: str) -> None:
    before = _pipe_threads()
    balance = [1, 1, 1, 2] if schedule == "interleaved" else [2, 3]
    pipe = Pipe(_model(), balance, chunks=3, schedule=schedule)
    mine = _pipe_threads() - before
    assert len(mine) == 2  # one per rank, made with the Pipe
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    pipe.step(x, y, nn.MSELoss())
    created = threading.Thread.__init__
    counts = []

    def counting(self: threading.Thread, *args: object, **kwargs: object) -> None:
        counts.append(self)
        created(self, *args, **kwargs)  # type: ignore[arg-type]

    threading.Thread.__init__ = counting  # type: ignore[method-assign]
    try:
        for _ in range(3):
            pipe.step(x, y, nn.MSELoss())
            pipe(x)
    finally:
        threading.Thread.__init__ = created  # type: ignore[method-assign]
    assert counts == []
    assert _pipe_threads() - before == mine
    pipe.close()
    _wait_gone(mine)


def test_one_rank_runs_in_the_callers_thread() -> None:
    before = _pipe_threads()
    pipe = Pipe(_model(), [5], chunks=2)
    pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss())
    assert _pipe_threads() == before


def test_garbage_collection_stops_the_workers() -> None:
    before = _pipe_threads()
    pipe = Pipe(_model(), [2, 3], chunks=2)
    pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss())
    mine = _pipe_threads() - before
    assert mine
    del pipe
    gc.collect()
    _wait_gone(mine)


def test_a_closed_pipe_says_so() -> None:
    pipe = Pipe(_model(), [2, 3], chunks=2)
    pipe.close()
    pipe.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss())


class _Stuck(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.release.wait(100)  # a stage that never finishes (until the test lets it go)
        return x


# Pipe(timeout=1): the stall is found after 1 s, and the other ranks get 1 s of grace. The
# bound on the whole call leaves a loaded machine plenty of slack, yet is far below the 100 s
# a stuck stage waits: a call that ended only because the stage gave up fails it.
TIMEOUT = 1.0
WITHIN = TIMEOUT + min(TIMEOUT, 5.0) + 30


def test_a_stuck_rank_fails_the_step_within_the_timeout_and_is_named() -> None:
    stuck = _Stuck()
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), stuck, nn.Linear(4, 4)), [2, 1], chunks=2,
                timeout=TIMEOUT)
    start = time.monotonic()
    try:
        with pytest.raises(PipelineError, match=r"rank 0 \(cpu\) is stuck at 0F0 \(forward of "
                                                r"stage 0, micro-batch 0\)(.|\n)*"
                                                r"rank\(s\) \[0\] did not stop"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
        assert time.monotonic() - start < WITHIN
        with pytest.raises(PipelineError, match="cannot run another step"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
    finally:
        stuck.release.set()


@pytest.mark.parametrize("call", ["step", "inference"])
def test_a_stuck_last_stage_fails_the_call_within_the_timeout(call: str) -> None:
    # Nobody fails first here: in inference the first rank finishes and nothing waits on the
    # last one, which hung pipe(x) forever; in a step the first rank gives up waiting and
    # must name the rank it waited for, not itself.
    stuck = _Stuck()
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), stuck), [1, 2], chunks=2,
                timeout=TIMEOUT)
    x = torch.randn(4, 4)
    start = time.monotonic()
    try:
        with pytest.raises(PipelineError) as err:
            if call == "step":
                pipe.step(x, torch.randn(4, 4), nn.MSELoss())
            else:
                pipe(x)
        seconds = time.monotonic() - start
        message = str(err.value)
        assert message.startswith("rank 1 (cpu) is stuck at 1F0 (forward of stage 1, "
                                  "micro-batch 0)"), message
        assert "Pipe(timeout=...)" in message
        assert "rank(s) [1] did not stop" in message
        assert seconds < WITHIN, seconds  # timeout 1 s, then 1 s of grace for the others
    finally:
        stuck.release.set()


def test_rank_workers_run_jobs_on_their_threads() -> None:
    workers = RankWorkers([torch.device("cpu")] * 3)
    seen: list[str] = []
    lock = threading.Lock()

    def job() -> None:
        with lock:
            seen.append(threading.current_thread().name)

    assert workers.run([job, job, job], failed=lambda: False, grace=1.0) == []
    assert sorted(seen) == ["pipe-rank-0", "pipe-rank-1", "pipe-rank-2"]
    workers.close()
    with pytest.raises(RuntimeError, match="closed"):
        workers.run([job, job, job], failed=lambda: False, grace=1.0)
