"""Pipe.clip_grad_norm_: the plain model's total norm and clipping, over stages and ties."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline import Pipe
from tests.models import lm_loss, tiny_lm
from tests.pipeline.parallel.test_ties import _batch


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clip_equals_torchs_on_the_plain_tied_model(norm_type: float, max_norm: float) -> None:
    reference = tiny_lm(dropout=0.0)
    model = copy.deepcopy(reference)
    pipe = Pipe(model, balance=[2, 3, 2], devices=["cpu"] * 3, chunks=3)
    x, y = _batch(3)
    lm_loss(reference(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    pipe.step(x, y, lm_loss)
    got = pipe.clip_grad_norm_(max_norm, norm_type)
    # fp32 gradients from another summation order; the norm sums a few hundred terms.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    plain = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, plain[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    pipe.close()


def test_a_nonfinite_norm_is_refused_when_asked() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    pipe = Pipe(model, balance=[1, 1], devices=["cpu", "cpu"])
    pipe.step(torch.randn(4, 3), torch.randn(4, 1), nn.MSELoss())
    model[1].weight.grad[0, 0] = float("inf")
    assert pipe.clip_grad_norm_(1.0).item() == float("inf")
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    pipe.close()


def test_clip_after_a_grad_scaler_unscales_equals_the_plain_models() -> None:
    reference = tiny_lm(dropout=0.0)
    model = copy.deepcopy(reference)
    pipe = Pipe(model, balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    x, y = _batch(4)
    norms = []
    for net, run in ((reference, None), (model, pipe)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        if run is None:
            scaler.scale(lm_loss(net(x), y)).backward()
        else:
            run.step(x, y, lm_loss, scaler=scaler)
        scaler.unscale_(optimizer)
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1) if run is None
                     else run.clip_grad_norm_(0.1))
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=1e-7)
    plain = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, plain[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    pipe.close()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_norm_keeps_the_gradients_dtype_as_torchs_does(dtype: torch.dtype) -> None:
    # It was computed in float32 whatever the gradients: a float64 model's norm was off by
    # 1e-10 relative, and so were its clipped gradients.
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 5)).to(dtype)
    model = copy.deepcopy(reference)
    pipe = Pipe(model, balance=[2, 1], devices=["cpu", "cpu"])
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        a.grad = torch.randn_like(a) * 3
        b.grad = a.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    got = pipe.clip_grad_norm_(0.5)
    assert got.dtype == want.dtype == dtype
    # The same per-gradient norms stacked in the same order: the same bits.
    assert torch.equal(got, want), (got.item(), want.item())
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    pipe.close()
