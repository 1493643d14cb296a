"""Losses that sum over the batch: detected from the loss module, or said with loss_reduction=."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe

TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32 sums in another order; losses here are O(10)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))


def _squared_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


@pytest.mark.parametrize(("loss_fn", "kwargs"), [
    (nn.MSELoss(reduction="sum"), {}),
    (nn.L1Loss(reduction="sum"), {}),
    (_squared_sum, {"loss_reduction": "sum"}),
])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_sum_reducing_losses_match_the_plain_model(
        loss_fn: Callable[[Any, Any], torch.Tensor], kwargs: dict[str, str],
        schedule: str) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [2, 3], chunks=3, schedule=schedule)  # 7 rows: 3, 2, 2
    x, y = torch.randn(7, 4), torch.randn(7, 3)
    loss = pipe.step(x, y, loss_fn, **kwargs)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL)


def test_sum_in_step_many() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [2, 3], chunks=2, schedule="2bw")
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    losses = pipe.step_many([(x, y)], _squared_sum, torch.optim.SGD(pipe.parameters(), lr=0.0),
                            loss_reduction="sum")
    torch.testing.assert_close(losses[0], _squared_sum(reference(x), y).detach(), **TOL)


@pytest.mark.parametrize(("loss_fn", "kwargs", "message"), [
    (nn.MSELoss(reduction="none"), {}, r"loss reduction must be .* \(got 'none'\)"),
    (_squared_sum, {"loss_reduction": "total"}, r"\(got 'total'\)"),
    (nn.MSELoss(reduction="sum"), {"loss_reduction": "mean"},
     r"loss_reduction='mean' but the loss module reduces by 'sum'"),
])
def test_unsupported_or_contradictory_reductions_are_refused(
        loss_fn: Callable[[Any, Any], torch.Tensor], kwargs: dict[str, str],
        message: str) -> None:
    pipe = Pipe(_model(), [2, 3], chunks=2)
    with pytest.raises(ValueError, match=message):
        pipe.step(torch.randn(4, 4), torch.randn(4, 3), loss_fn, **kwargs)
