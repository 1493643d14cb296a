"""Models, snapshots and spawned-rank functions for tests/pipeline/state/test_sharded.py (importable
by child processes, so they live in a module of their own)."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

from pipeline import Pipe, PipeConfigError
from pipeline.state import sharded


def model(seed: int, *, extra: bool = False) -> nn.Sequential:
    """Six layers (BatchNorm's buffers among them), a seventh with `extra`."""
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 16), nn.Tanh(), nn.BatchNorm1d(16), nn.Linear(16, 16), nn.GELU(),
              nn.Linear(16, 3)]
    return nn.Sequential(*layers, *([nn.Linear(3, 3)] if extra else []))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def adam(module: nn.Module, lr: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=lr)


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One Adam step on batch `step`: `pipe.step` for a Pipe (each rank passes what it
    needs), forward and backward for a plain module."""
    x, y = batch(step)
    optimizer.zero_grad(set_to_none=True)
    if isinstance(module, Pipe):
        first, last = 0 in module.local_stages, len(module.balance) - 1 in module.local_stages
        module.step(x if first else None, y if last else None, nn.MSELoss())
    else:
        nn.MSELoss()(module(x), y).backward()
    optimizer.step()


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters and buffers by key, the optimizer's state by parameter name ("3.weight:
    exp_avg") and its hyperparameters ("3.weight: lr"), as CPU copies."""
    out: dict[str, Any] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    names = {id(p): n for n, p in module.named_parameters()}
    for p, state in optimizer.state.items():
        for k, v in state.items():
            out[f"{names[id(p)]}: {k}"] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.update({f"{names[id(p)]}: {k}": v for k, v in group.items() if k != "params"})
    return out


def assert_same(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Same keys, and every value bitwise equal."""
    assert sorted(got) == sorted(expected), f"{what}: keys differ: {set(got) ^ set(expected)}"
    for k, v in expected.items():
        same = torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v
        assert same, f"{what}: {k} differs: {got[k]} != {v}"


def save_trained(path: Any, seed: int = 0) -> dict[str, Any]:
    """A plain model and Adam, one step trained, saved to `path` in this process; their
    snapshot."""
    plain = model(seed)
    optimizer = adam(plain)
    train_step(plain, optimizer, 0)
    sharded.save(plain, path, optimizer)
    return snapshot(plain, optimizer)


def load_fresh(path: Any) -> dict[str, Any]:
    """A fresh model (other weights, another lr) loaded from `path` in this process; its
    snapshot."""
    target = model(9)
    optimizer = adam(target, lr=0.5)
    sharded.load(target, path, optimizer)
    return snapshot(target, optimizer)


def pack(snap: dict[str, Any]) -> bytes:
    """A snapshot as bytes: tensors sent back from a rank through the result queue would be
    shared memory, gone once that rank exits."""
    buffer = io.BytesIO()
    torch.save(snap, buffer)
    return buffer.getvalue()


def unpack(parts: list[bytes]) -> dict[str, Any]:
    """The ranks' packed snapshots as one."""
    out: dict[str, Any] = {}
    for part in parts:
        out.update(torch.load(io.BytesIO(part), weights_only=True))
    return out


# -- spawned ranks ------------------------------------------------------------------------------
def train_save_continue(rank: int, path: str, balance: list[int]) -> tuple[bytes, bytes]:
    """One step, save, one more step: (this rank's snapshot as saved, after
    the next step; packed)."""
    pipe = Pipe(model(0), balance)
    optimizer = adam(pipe)
    train_step(pipe, optimizer, 0)
    sharded.save(pipe, path, optimizer)
    saved = pack(snapshot(pipe, optimizer))
    train_step(pipe, optimizer, 1)
    return saved, pack(snapshot(pipe, optimizer))


def load_continue(rank: int, path: str, balance: list[int], misfit: bool
                  ) -> tuple[str, bytes, bytes]:
    """Load into a Pipe built from other weights (optimizer with another lr), then one step:
    (the error a misfitting model got first, if `misfit`; this rank's snapshot as loaded,
    after the step; packed)."""
    error = ""
    if misfit:  # only the last rank misses keys; every rank must raise (none waits in DCP)
        wrong = Pipe(model(3, extra=True), [*balance[:-1], balance[-1] + 1])
        try:
            sharded.load(wrong, path, adam(wrong))
        except PipeConfigError as exc:
            error = str(exc)
    pipe = Pipe(model(7), balance)
    optimizer = adam(pipe, lr=0.5)
    sharded.load(pipe, path, optimizer)
    loaded = pack(snapshot(pipe, optimizer))
    train_step(pipe, optimizer, 1)
    return error, loaded, pack(snapshot(pipe, optimizer))
