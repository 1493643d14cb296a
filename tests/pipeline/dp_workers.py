"""Functions run on spawned gloo ranks by tests/pipeline/parallel/test_data_parallel.py
(importable by child processes, so they live in a module of their own)."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipeline import Pipe, PipelineError
from tests.pipeline.dist_workers import TOL, _model


def _global_batch(step: int, rows: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def _shard(t: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """Uneven shards: replica r takes rows [bounds[r], bounds[r+1])."""
    rows = t.shape[0]
    bounds = [rows * r // dp + (1 if r else 0) for r in range(dp)] + [rows]
    return t[bounds[dp_rank]:bounds[dp_rank + 1]]


def equivalence(rank: int, dp: int, pp: int, combos: list[tuple[str, str, list[int]]],
                reductions: tuple[str, ...] = ("mean",)) -> int:
    """dp x pp: each replica steps its uneven shard; the loss is the global batch's and every
    gradient the single-device model's on the global batch, over two steps (accumulating)."""
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    checked = 0
    for (schedule, checkpoint, balance), reduction in (
            (c, r) for c in combos for r in reductions):
        loss_fn = nn.MSELoss(reduction=reduction)
        model, reference = _model(), _model()
        pipe = Pipe(model, balance, chunks=2, schedule=schedule, checkpoint=checkpoint,
                    mesh=mesh)
        for step in range(2):  # no zero_grad between: gradients accumulate, as on one device
            x, y = _global_batch(step)
            loss = pipe.step(_shard(x, dp_rank, dp), _shard(y, dp_rank, dp), loss_fn)
            expected = loss_fn(reference(x), y)
            expected.backward()
            torch.testing.assert_close(loss, expected.detach(), **TOL)
            ref = dict(reference.named_parameters())
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad, ref[name].grad, **TOL,
                                           msg=lambda m, n=f"{schedule}: {name}": f"{n}: {m}")
        checked += 1
    return checked


def stats(rank: int) -> dict[str, float]:
    """The share of the gradient all-reduce the pipeline hid, as the Pipe reports it."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pipe = Pipe(_model(), [4, 4], chunks=4, mesh=mesh)
    x, y = _global_batch(0, 32)
    pipe.step(x, y, nn.MSELoss())
    return pipe.data_parallel_stats()


def killed_mid_step(rank: int) -> str:
    """Global rank 3 (dp 1, pp 1) dies in its second step; every other rank names it."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))

    class _Die(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if rank == 3 and self.training and getattr(self, "armed", False):
                os.kill(os.getpid(), signal.SIGKILL)
            return x

    die = _Die()
    model = nn.Sequential(*_model(), die)
    pipe = Pipe(model, [4, 5], chunks=2, mesh=mesh, timeout=60)
    x, y = _global_batch(0, 8)
    pipe.step(x, y, nn.MSELoss())
    die.armed = True
    start = time.monotonic()
    try:
        pipe.step(x, y, nn.MSELoss())
    except PipelineError as exc:
        return f"{time.monotonic() - start:.1f}s: {exc}"
    return "no error"


def disagreeing_replicas(rank: int) -> str:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
    pipe = Pipe(_model(), [8], chunks=[2, 4][rank], mesh=mesh, timeout=60)
    x, y = _global_batch(0, 8)
    try:
        pipe.step(x, y, nn.MSELoss())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def zero_one(rank: int) -> bool:
    """ZeRO-1 (torch's ZeroRedundancyOptimizer over the dp group) on a 2 x 2 mesh: three Adam
    steps equal plain Adam on one device."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    model, reference = _model(), _model()
    pipe = Pipe(model, [4, 4], chunks=2, mesh=mesh)
    optimizer = ZeroRedundancyOptimizer(list(pipe.parameters()), optimizer_class=torch.optim.Adam,
                                        process_group=mesh.get_group("dp"), lr=1e-2)
    plain = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _global_batch(step)
        optimizer.zero_grad()
        plain.zero_grad()
        pipe.step(_shard(x, dp_rank, 2), _shard(y, dp_rank, 2), nn.MSELoss())
        nn.MSELoss()(reference(x), y).backward()
        optimizer.step()
        plain.step()
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=1e-6)
    return True




def checkpoint_moves(rank: int, dp: int, pp: int, path: str, save: bool) -> bool:
    """Train one step on a dp x pp mesh from the checkpoint at `path` (or from the seed's
    weights), compare with one device, and (if `save`) write full_state_dict and a sharded
    checkpoint for the next mesh shape."""
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    reference = _model()
    balance = [8] if pp == 1 else [4, 4]
    pipe = Pipe(_model(seed=7), balance, chunks=2, mesh=mesh)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    plain = torch.optim.Adam(reference.parameters(), lr=1e-2)
    if os.path.exists(f"{path}/full.pt"):
        start = torch.load(f"{path}/full.pt")
        reference.load_state_dict(start)
        pipe.load(f"{path}/sharded", optimizer)  # the optimizer state travels too
        plain.load_state_dict(torch.load(f"{path}/plain-optimizer.pt"))
    else:
        pipe.load_state_dict(reference.state_dict())
    x, y = _global_batch(3)
    pipe.step(_shard(x, dp_rank, dp), _shard(y, dp_rank, dp), nn.MSELoss())
    nn.MSELoss()(reference(x), y).backward()
    optimizer.step()
    plain.step()
    full = pipe.full_state_dict()
    if full is not None and rank == 0:
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key], value, **TOL)
        if save:
            torch.save(full, f"{path}/full.pt")
            torch.save(plain.state_dict(), f"{path}/plain-optimizer.pt")
    if save:
        pipe.save(f"{path}/sharded", optimizer)
    return True


def fsdp(rank: int, combos: list[tuple[str, str]]) -> int:
    """FSDP2 over "dp" on a 2 x 2 mesh: every gradient (gathered) is the global batch's, and
    three Adam steps equal plain Adam on one device."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    for schedule, checkpoint in combos:
        model, reference = _model(), _model()
        pipe = Pipe(model, [4, 4], chunks=2, schedule=schedule, checkpoint=checkpoint,
                    mesh=mesh, data_parallel="fsdp")
        optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
        plain = torch.optim.Adam(reference.parameters(), lr=1e-2)
        for step in range(3):
            x, y = _global_batch(step)
            optimizer.zero_grad()
            plain.zero_grad()
            loss = pipe.step(_shard(x, dp_rank, 2), _shard(y, dp_rank, 2), nn.MSELoss())
            expected = nn.MSELoss()(reference(x), y)
            expected.backward()
            torch.testing.assert_close(loss, expected.detach(), **TOL)
            ref = dict(reference.named_parameters())
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad.full_tensor(), ref[name].grad, **TOL)
            optimizer.step()
            plain.step()
        ref = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.full_tensor(), ref[name], rtol=1e-5, atol=1e-6)
    return len(combos)
