"""Functions run on spawned gloo ranks by tests/pipeline/test_auto_schedule.py: `schedule="auto"`
measured over processes (importable by child processes, so in a module of their own)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from pipeline import Pipe, PipelineError

__all__ = ["FAILURE_TIMEOUT", "TOL", "measured", "unequal_model", "unmeasurable"]

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, summation order only (see tests/test_transparency.py)
# Pipe(timeout=...) where a rank fails: a failure only the timeout ended would take this long.
FAILURE_TIMEOUT = 300.0


def unequal_model(seed: int = 0, width: int = 16, head: int = 8) -> nn.Sequential:
    """Two cheap blocks, then a head `head` times wider than them: stages of unequal cost."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, head * width), nn.GELU(), nn.Linear(head * width, 3))


def measured(rank: int, steps: int = 3) -> dict[str, Any]:
    """`steps` SGD steps under schedule="auto" (the first measured), each equal to one device's
    (loss, this rank's gradients and weights); returns what this rank synthesised from and ran."""
    model = unequal_model()
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [4, 3], chunks=4, schedule="auto", checkpoint="except_last")
    assert pipe.auto is not None
    warm_up = [[str(a) for a in row] for row in pipe.auto.schedule.actions]
    ours = torch.optim.SGD(pipe.parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    ran = []
    for step in range(steps):
        torch.manual_seed(step)
        x, y = torch.randn(10, 6), torch.randn(10, 3)  # 3, 3, 2, 2 rows per micro-batch
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        first, last = 0 in pipe.local_stages, 1 in pipe.local_stages
        loss = pipe.step(x if first else None, y if last else None, nn.MSELoss())
        expected = nn.MSELoss()(reference(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), **TOL)
        ref = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(p.grad, ref[name].grad, **TOL,
                                       msg=lambda m, n=name, k=step: f"step {k}: {n}: {m}")
        ours.step()
        theirs.step()
        ran.append([str(e.action) for e in pipe.last_timeline().events])
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, dict(reference.named_parameters())[name], **TOL)
    assert pipe.auto.costs is not None and pipe.auto.synthesis is not None
    return {"costs": repr(pipe.auto.costs), "chosen": pipe.auto.synthesis.chosen,
            "schedule": [[str(a) for a in row] for row in pipe.auto.schedule.actions],
            "warm_up": warm_up, "ran": ran}


def unmeasurable(rank: int) -> tuple[str, float]:
    """Rank 1 fails while measuring the first step (after the step itself succeeded); returns
    the error each rank raised and how long after the step it came."""
    pipe = Pipe(unequal_model(), [4, 3], chunks=4, schedule="auto", timeout=FAILURE_TIMEOUT)
    assert pipe.auto is not None
    if rank == 1:
        def broken() -> str:
            raise OSError("no clock")
        pipe.auto.measure = broken  # type: ignore[method-assign]
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    start = time.monotonic()
    try:
        pipe.step(x if rank == 0 else None, y if rank == 1 else None, nn.MSELoss())
    except PipelineError as exc:
        assert pipe.auto.costs is None  # nothing was synthesised from half the numbers
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start
