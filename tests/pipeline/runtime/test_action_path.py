"""A compute action does no per-action work that its stage does not need: counted, not timed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.runtime import batchnorm, recompute

_M = 4  # micro-batches: 2 stages x 4 forwards per step


def _model(extra: Callable[[], nn.Module] | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)]
    if extra is not None:
        layers.insert(2, extra())
    return nn.Sequential(*layers, nn.Linear(8, 4))


def _counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _steps(pipe: Pipe, count: int) -> None:
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for _ in range(count):
        pipe.step(x, y, nn.functional.mse_loss)


def _seeds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the seeds computed, wherever the runtime computes them."""
    calls = [0]
    original = recompute.stage_seed

    def counted(*args: int) -> int:
        calls[0] += 1
        return original(*args)
    # Every module of the package that took the function by name, so that a seed computed in
    # a module the runtime moves it to is still counted.
    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("pipeline.") and getattr(m, "stage_seed", None) is original]
    assert recompute in holders, holders
    for module in holders:
        monkeypatch.setattr(module, "stage_seed", counted)
    return calls


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_forward_that_draws_nothing_computes_no_seed(monkeypatch: pytest.MonkeyPatch,
                                                       checkpoint: str) -> None:
    pipe = Pipe(_model(), [2, 2], chunks=_M, checkpoint=checkpoint, devices=["cpu", "cpu"])
    _steps(pipe, 1)  # the first forward of each stage finds out that it draws nothing
    seeds = _seeds(monkeypatch)
    _steps(pipe, 2)
    assert seeds[0] == 0


def test_a_forward_that_draws_is_seeded_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stage 0 has the dropout, stage 1 not: each of stage 0's forwards and replays is seeded.
    pipe = Pipe(_model(lambda: nn.Dropout(0.5)), [3, 2], chunks=_M, checkpoint="always",
                devices=["cpu", "cpu"])
    _steps(pipe, 1)
    seeds = _seeds(monkeypatch)
    _steps(pipe, 2)
    # "always" checkpoints every micro-batch: a forward and a replay of each on stage 0
    assert seeds[0] == 2 * 2 * _M


def test_the_microbatch_scope_only_around_stages_with_batchnorm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The scope tells deferred BatchNorm's hooks the micro-batch; a stage without a BatchNorm
    # layer has no reader for it.
    pipe = Pipe(_model(lambda: nn.BatchNorm1d(8)), [3, 2], chunks=_M, checkpoint="never",
                devices=["cpu", "cpu"], deferred_batch_norm=True)
    _steps(pipe, 1)
    entered = _counting(monkeypatch, batchnorm._Scope, "__enter__")
    _steps(pipe, 2)
    assert entered[0] == 2 * _M  # stage 0's forwards only


def test_the_runtime_adds_few_calls_per_compute_action() -> None:
    # Function calls under cProfile are exact at any load: what a compute action of the
    # stage runtime calls beyond the bare layers and autograd (benchmarks/action_cost.py).
    from benchmarks.action_cost import Config, measure

    r = measure(Config(model="small", microbatches=(8,), schedules=("interleaved",), steps=2,
                       warmup=2, profiled=3), "interleaved", 8)
    # 38.2 before the forward became the bare call, 29.2 after: a few calls of slack for
    # changes elsewhere, none for the wrappers coming back.
    assert r.calls_per_action - r.bare_calls_per_action <= 32, r
