"""pipe.step(..., losses=[]): each micro-batch's own loss, in order, as torch's `losses=`."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeline import Pipe, PipeConfigError


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])


@pytest.mark.parametrize(("schedule", "balance"), [
    ("gpipe", [2, 2]), ("1f1b", [2, 2]), ("interleaved", [1, 1, 1, 1]), ("zb-h1", [2, 2])])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_losses_are_each_microbatchs_own_loss_in_order(schedule: str, balance: list[int],
                                                       checkpoint: str) -> None:
    """Was: `losses=` was refused (TypeError). Seven rows in three micro-batches (3, 2, 2, as
    `torch.tensor_split` cuts them): each entry is `loss_fn` on that micro-batch of the plain
    model, bit for bit, and the step's loss is their mean weighted by rows."""
    model = _mlp()
    torch.manual_seed(1)
    x, y = torch.randn(7, 6), torch.randn(7, 6)
    expected = [nn.MSELoss()(model(a), b).detach()
                for a, b in zip(x.tensor_split(3), y.tensor_split(3), strict=True)]
    pipe = Pipe(model, balance, devices=["cpu", "cpu"], chunks=3, schedule=schedule,
                checkpoint=checkpoint)
    losses: list[torch.Tensor] = [torch.tensor(5.0)]  # cleared first, as torch's
    loss = pipe.step(x, y, nn.MSELoss(), losses=losses)
    assert len(losses) == 3
    for got, want in zip(losses, expected, strict=True):
        assert torch.equal(got, want) and not got.requires_grad
    weighted = sum(got * rows / 7 for got, rows in zip(losses, (3, 2, 2), strict=True))
    torch.testing.assert_close(loss, weighted)
    pipe.close()


def test_a_microbatch_with_nothing_counted_reports_nan() -> None:
    """A micro-batch whose targets are all ignored adds nothing to the batch's loss; its own
    loss is a mean over nothing: NaN, as `F.cross_entropy` gives it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 5))
    x, y = torch.randn(4, 4), torch.tensor([1, 2, -100, -100])
    pipe = Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    losses: list[torch.Tensor] = []
    loss = pipe.step(x, y, nn.CrossEntropyLoss(), losses=losses)
    assert math.isnan(losses[1]) and not math.isnan(losses[0])
    assert torch.equal(losses[0], nn.CrossEntropyLoss()(model(x[:2]), y[:2]).detach())
    assert torch.equal(loss, losses[0])  # the batch's two counted targets are micro-batch 0's
    pipe.close()


def test_losses_must_be_a_list() -> None:
    pipe = Pipe(_mlp(), [2, 2], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(PipeConfigError, match=r"losses must be a list .* \(got tuple\): pass "
                                              r"losses=\[\]") as raised:
        pipe.step(torch.randn(4, 6), torch.randn(4, 6), nn.MSELoss(), losses=())  # type: ignore[arg-type]
    assert isinstance(raised.value, TypeError)
    pipe.close()
