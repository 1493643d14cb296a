"""Pipe passes values exactly as nn.Sequential does: input gradients, tuple structure, in-place."""

import copy
from typing import Any

import pytest
import torch
from torch import nn

import schedules
from pipeline import Pipe
from tests.pipeline.dist_workers import Pack, Unpack

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, summation order only (see test_transparency)


class Combine(nn.Module):
    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = t
        return a + a * b


def _plain_step(model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    loss = nn.MSELoss()(out[0] if isinstance(out, tuple) else out, y)
    loss.backward()
    return loss.detach()


def _names() -> list[str]:
    return [n for n in schedules.available() if not schedules.info(n).multi_batch]


@pytest.mark.parametrize("name", _names())
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_input_gradient_is_filled(name: str, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    reference = copy.deepcopy(model)
    per_rank = schedules.info(name).stages_per_rank
    x = torch.randn(7, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = torch.randn(7, 6)
    pipe = Pipe(model, [1, 1, 1, 1], devices=["cpu"] * (4 // per_rank), chunks=3, schedule=name,
                checkpoint=checkpoint)
    pipe.step(x, y, nn.MSELoss())
    _plain_step(reference, x_ref, y)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)


def test_input_gradient_flows_into_the_graph_before_the_pipe() -> None:
    torch.manual_seed(0)
    embed, model = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    embed_ref, model_ref = copy.deepcopy(embed), copy.deepcopy(model)
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    Pipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2).step(embed(x), y, nn.MSELoss())
    _plain_step(model_ref, embed_ref(x), y)
    torch.testing.assert_close(embed.weight.grad, embed_ref.weight.grad, **TOL)


def test_tuple_inputs_get_their_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Combine(), nn.Linear(3, 3))
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    ids = torch.arange(4)  # no gradient: stays None
    a2, b2 = (t.detach().clone().requires_grad_() for t in (a, b))

    class Drop(nn.Module):
        def forward(self, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            return t[0], t[1]

    pipe_model = nn.Sequential(Drop(), *copy.deepcopy(model))
    Pipe(pipe_model, [1, 2], devices=["cpu", "cpu"], chunks=2).step(
        (a, b, ids), torch.full((4, 3), 0.5), lambda out, t: nn.MSELoss()(out, t))
    _plain_step(model, (a2, b2), torch.full((4, 3), 0.5))
    torch.testing.assert_close(a.grad, a2.grad, **TOL)
    torch.testing.assert_close(b.grad, b2.grad, **TOL)


@pytest.mark.parametrize("balance", [[1, 1, 1], [2, 1], [1, 2], [3]])
def test_one_tuples_keep_their_structure(balance: list[int]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Pack(), Unpack())
    pipe = Pipe(model, balance, devices=["cpu"] * len(balance), chunks=2)
    x = torch.randn(6, 4)
    torch.testing.assert_close(pipe(x), model(x), **TOL)


def test_one_tuple_at_the_input_and_the_output() -> None:
    model = nn.Sequential(Unpack(), Pack())
    pipe = Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 3)
    out = pipe((x,))
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], x * 2)


def test_one_tuple_output_through_a_training_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Pack(), Unpack(), nn.Linear(4, 2), Pack())
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    loss_fn = lambda out, t: nn.MSELoss()(out[0], t)  # noqa: E731
    pipe = Pipe(model, [2, 3], devices=["cpu", "cpu"], chunks=3)
    loss = pipe.step(x, y, loss_fn)
    expected = _plain_step(reference, x, y)
    torch.testing.assert_close(loss, expected, **TOL)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_inplace_first_layer_of_a_stage_trains(checkpoint: str, name: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4),
                          nn.Dropout(0.5, inplace=True), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    pipe = Pipe(model, [1, 2, 2], devices=["cpu"] * 3, chunks=3, schedule=name,
                checkpoint=checkpoint)
    model.eval(), reference.eval()  # dropout off: the masks are the pipe's own
    loss = pipe.step(x, y, nn.MSELoss())
    expected = _plain_step(reference, x, y)
    torch.testing.assert_close(loss, expected, **TOL)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_inplace_first_layer_in_inference() -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 3))
    x = torch.randn(4, 3)
    expected = nn.Sequential(nn.ReLU(), copy.deepcopy(model[1]))(x.clone())
    out = Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="always")(x)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("name", schedules.available())
def test_tied_weights_within_a_stage_get_one_gradient(name: str) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), shared, nn.Tanh(), shared, nn.Linear(4, 4),
                          nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    per_rank = schedules.info(name).stages_per_rank
    balance = [1, 3, 2] if per_rank == 1 else [1, 3, 1, 1]  # both uses in one stage
    pipe = Pipe(model, balance, devices=["cpu"] * (len(balance) // per_rank), chunks=3,
                schedule=name)
    loss = pipe.step(x, y, nn.MSELoss())  # 2BW's first step runs at the initial weights
    expected = _plain_step(reference, x, y)
    torch.testing.assert_close(loss, expected, **TOL)
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
