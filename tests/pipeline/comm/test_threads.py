"""pipeline.comm.threads: the in-process mailbox (ordering, timeouts, aborts)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import schedules
from pipeline.comm.failures import PipelineAborted
from pipeline.comm.threads import ThreadTransport

CPU = torch.device("cpu")


def test_mailbox_delivers_by_message_with_grad_flags_kept() -> None:
    box = ThreadTransport(timeout=5.0)
    box.begin(schedules.get_schedule("gpipe", 2, 2))
    sent = torch.randn(3, requires_grad=True) + 1
    box.send(("F", 1, 1), (sent, torch.ones(1, dtype=torch.bool)), 1)
    box.send(("F", 1, 0), (torch.zeros(1),), 1)
    first = box.wait(("F", 1, 0), 0, CPU)  # any order: messages are keyed
    second = box.wait(("F", 1, 1), 0, CPU)
    assert torch.equal(first[0], torch.zeros(1))
    assert second[0].requires_grad and second[0].is_leaf and torch.equal(second[0], sent)
    assert second[1].dtype == torch.bool and not second[1].requires_grad


def test_a_wait_times_out_naming_what_it_waited_for() -> None:
    box = ThreadTransport(timeout=0.2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0.2s for the gradients of stage 1, micro-batch 3 "
                                           r"from rank 2; raise Pipe\(timeout=...\)"):
        box.wait(("B", 1, 3), 2, CPU)
    assert time.monotonic() - start < 5


@pytest.mark.timeout(30)
def test_abort_wakes_a_waiting_rank_with_the_failed_rank() -> None:
    box = ThreadTransport(timeout=60.0)
    caught: list[BaseException] = []

    def wait() -> None:
        try:
            box.wait(("F", 1, 0), 0, CPU)
        except BaseException as exc:
            caught.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)  # not an ordering assumption: the abort is seen whenever the wait starts
    box.abort(0, "rank 0 failed")
    waiter.join(10)
    assert not waiter.is_alive()
    assert isinstance(caught[0], PipelineAborted) and caught[0].rank == 0
    # The first failure is kept; begin() clears it for the next step.
    box.abort(1, "later")
    with pytest.raises(PipelineAborted, match="rank 0 failed"):
        box.wait(("F", 1, 0), 0, CPU)
    box.begin(schedules.get_schedule("gpipe", 2, 1))
    box.send(("F", 1, 0), (torch.ones(1),), 1)
    assert torch.equal(box.wait(("F", 1, 0), 0, CPU)[0], torch.ones(1))


def test_a_plain_cuda_device_gets_the_current_gpus_index_and_a_missing_gpu_is_refused() -> None:
    """A rank's thread binds to its GPU by index (torch.cuda.set_device refuses plain "cuda"),
    so "cuda" means the current GPU, as torch places tensors; an index past the visible GPUs
    is a PipeConfigError before any thread starts (it used to kill the rank's thread)."""
    from pipeline.comm.bootstrap import indexed
    from pipeline.errors import PipeConfigError

    assert indexed(torch.device("cuda"), count=2, current=1) == torch.device("cuda", 1)
    assert indexed(torch.device("cuda", 1), count=2) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu"), count=0) == torch.device("cpu")
    with pytest.raises(PipeConfigError, match=r"cuda:2 was asked for but 2 GPU\(s\)"):
        indexed(torch.device("cuda", 2), count=2)


def test_a_rank_thread_that_cannot_bind_its_gpu_still_runs_its_jobs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's thread that failed to bind its GPU used to die before its first job, and the
    caller waited for that job forever: it must run its jobs (their tensors name the device)."""
    from pipeline.runtime.workers import RankWorkers

    def refuse(device: object) -> None:
        raise ValueError("no such GPU")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    workers = RankWorkers([torch.device("cuda", 0)])
    ran: list[int] = []
    try:
        assert workers.run([lambda: ran.append(1)], failed=lambda: False, grace=1.0) == []
    finally:
        workers.close()
    assert ran == [1]
