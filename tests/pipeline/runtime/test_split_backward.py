"""pipeline.runtime.split_backward: I then W give exactly the gradients of one fused backward."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipeline.runtime.split_backward import backward_input, backward_weight

TOL = {"rtol": 1e-6, "atol": 1e-7}  # the same kernels on the same values: rounding only


class _Tied(nn.Module):
    """A residual block using one Linear twice (tied weights within a stage) plus a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(5, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        return self.norm(x + self.shared(h))


def _fused(module: nn.Module, x: torch.Tensor, g: torch.Tensor
           ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    x = x.detach().requires_grad_(True)
    module(x).backward(g)
    return x.grad, [p.grad for p in module.parameters()]


def test_input_then_weight_equals_one_backward_with_tied_weights() -> None:
    torch.manual_seed(0)
    split = _Tied()
    fused = copy.deepcopy(split)
    x, g = torch.randn(4, 5), torch.randn(4, 5)
    want_dx, want_dw = _fused(fused, x, g)
    xi = x.detach().requires_grad_(True)
    out = split(xi)
    params = list(split.parameters())
    dx, state = backward_input([out], [g], [xi, "not a tensor"], params)
    assert dx[1] is None
    torch.testing.assert_close(dx[0], want_dx, **TOL)
    assert all(p.grad is None for p in params)  # I computes no weight gradient
    backward_weight(state)
    for p, want in zip(params, want_dw, strict=True):
        torch.testing.assert_close(p.grad, want, **TOL)
    assert not state.groups and not state.grads  # what only W needed is freed


def test_weight_gradients_accumulate_into_existing_grad() -> None:
    torch.manual_seed(1)
    layer = nn.Linear(3, 2)
    x, g = torch.randn(4, 3), torch.randn(4, 2)
    _, once = _fused(copy.deepcopy(layer), x, g)
    existing = [torch.ones_like(p) for p in layer.parameters()]
    for p, e in zip(layer.parameters(), existing, strict=True):
        p.grad = e
    xi = x.requires_grad_(True)
    _, state = backward_input([layer(xi)], [g], [xi], list(layer.parameters()))
    backward_weight(state)
    for p, e, w in zip(layer.parameters(), existing, once, strict=True):
        assert p.grad is e  # in place, as autograd accumulates
        torch.testing.assert_close(p.grad, 1 + w, **TOL)


def test_without_inputs_needing_grad_the_whole_backward_is_weight_work() -> None:
    torch.manual_seed(2)
    layer = nn.Linear(3, 2)
    x, g = torch.randn(4, 3), torch.randn(4, 2)  # x needs no gradient: the first stage
    _, want = _fused(copy.deepcopy(layer), x, g)
    dx, state = backward_input([layer(x)], [g], [x], list(layer.parameters()))
    assert dx == [None] and state.fallback is not None
    assert all(p.grad is None for p in layer.parameters())
    backward_weight(state)
    for p, w in zip(layer.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, **TOL)


def test_frozen_parameters_get_no_gradient() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    x = torch.randn(4, 3, requires_grad=True)
    _, state = backward_input([model(x)], [torch.ones(4, 2)], [x], list(model.parameters()))
    backward_weight(state)
    assert model[0].weight.grad is None and model[2].weight.grad is not None


class _EncoderDecoderStage(nn.Module):
    """A stage as an encoder-decoder's middle one: the encoder's layer on the incoming
    activation, and beside it the decoder's embedding of its own ids plus learned positions,
    a branch that never meets the incoming activation; the embedding is also used on the
    encoder's side (one weight on both branches), and a position bias made from parameters
    alone is handed on as a third output (as T5's), broadcast over the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(5, 5)
        self.embed = nn.Embedding(7, 5)
        self.positions = nn.Parameter(torch.randn(5))
        self.bias = nn.Parameter(torch.randn(3, 5))

    def forward(self, h: torch.Tensor, ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        encoded = torch.tanh(self.layer(h) + self.embed.weight[0])
        decoded = self.embed(ids) * 2 + self.positions
        return encoded, decoded, self.bias.sum(0).expand(h.shape[0], -1)


def test_branches_that_never_meet_the_input_get_their_weight_gradients() -> None:
    """Every parameter gets what one fused backward gives it, through the incoming
    activation's path (I records, W replays) and through outputs off that path (W starts
    from the outputs): none dropped, none counted twice; over two micro-batches, the second
    accumulating onto the first (the position bias's first gradient is a broadcast view)."""
    torch.manual_seed(4)
    split = _EncoderDecoderStage()
    fused = copy.deepcopy(split)
    params = list(split.parameters())
    for m in range(2):
        x, ids = torch.randn(4, 5), torch.randint(0, 7, (4,))
        grads = [torch.randn(4, 5) for _ in range(3)]
        xf = x.detach().requires_grad_(True)
        torch.autograd.backward(fused(xf, ids), grads)
        xi = x.detach().requires_grad_(True)
        dx, state = backward_input(list(split(xi, ids)), grads, [xi, ids], params)
        torch.testing.assert_close(dx[0], xf.grad, **TOL)
        assert dx[1] is None
        assert all(p.grad is None for p in params) or m == 1  # I computes no weight gradient
        backward_weight(state)
        for (name, p), q in zip(split.named_parameters(), fused.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda e, n=name: f"{n}: {e}")
        assert not state.groups and not state.grads and not state.seeds
