"""CUDA paths: device placement, side-stream copies, NCCL. Skipped without enough GPUs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.launch import spawn
from tests.pipeline import dist_workers

pytestmark = pytest.mark.gpu
TOL = {"rtol": 1e-4, "atol": 1e-5}  # TF32 is off by default for matmuls; cuBLAS order differs


def _gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s)")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved", "2bw"])
def test_cuda_pipe_equals_single_device(schedule: str) -> None:
    _gpus(1)
    n = min(2, torch.cuda.device_count())
    devices = [f"cuda:{i % n}" for i in range(2)]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])
    reference = copy.deepcopy(model).cuda()
    x, y = torch.randn(24, 64), torch.randn(24, 64)
    balance = [2, 2, 2, 2] if schedule == "interleaved" else [4, 4]
    pipe = Pipe(model, balance, devices=devices, chunks=5, schedule=schedule,
                checkpoint="except_last")
    loss = pipe.step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(reference(x.cuda()), y.cuda())
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach().cpu(), **TOL)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), **TOL)
    assert pipe(x).device == torch.device(devices[-1])


def test_dropout_replay_on_cuda() -> None:
    _gpus(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    grads = []
    for checkpoint in ("never", "always"):
        m = copy.deepcopy(model)
        pipe = Pipe(m, [2, 1], devices=["cuda:0", "cuda:0"], chunks=2, checkpoint=checkpoint)
        torch.manual_seed(7)
        pipe.step(torch.randn(8, 16), torch.randn(8, 4), nn.MSELoss())
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_nccl_two_ranks() -> None:
    _gpus(2)
    combos = [("1f1b", "never"), ("zb-h1", "always"), ("interleaved", "except_last")]
    balances = {"1f1b": [4, 4], "zb-h1": [4, 4], "interleaved": [2, 2, 2, 2]}
    assert spawn(dist_workers.equivalence, 2, combos, balances, backend="nccl",
                 timeout=200) == [6, 6]
