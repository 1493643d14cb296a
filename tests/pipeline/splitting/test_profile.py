"""pipeline.splitting.profile: per-layer costs, measured as nn.Sequential runs them, no side
effect."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.splitting.profile import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    layer_params,
    layer_sizes,
    layer_times,
)

PROFILERS: dict[str, Callable[[nn.Sequential, Any], list[float]]] = {
    "time": lambda model, sample: layer_times(model, sample, repeats=2),
    "size": layer_sizes,
}


class _Split(nn.Module):
    """Returns a 2-tuple: nn.Sequential hands it to the next layer as one argument."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x * 2


class _Join(nn.Module):
    """Takes a tuple as its single argument."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return self.linear(a + b)


class _Wrap(nn.Module):
    """Returns a 1-tuple."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x,)


class _Unwrap(nn.Module):
    """Indexes its argument: on a bare tensor it would silently take the first row."""

    def forward(self, t: tuple[torch.Tensor]) -> torch.Tensor:
        assert isinstance(t, tuple) and len(t) == 1, f"expected a 1-tuple, got {type(t)}"
        return t[0] * 2


class _Pair(nn.Module):
    """Takes the sample tuple (x, mask) as one argument, as model((x, mask)) gives it."""

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = batch
        return x * mask


def _tuple_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Pair(), nn.Linear(4, 4), _Split(), _Join(), _Wrap(), _Unwrap(),
                         nn.Linear(4, 2))


def _stateful_model() -> nn.Sequential:
    """BatchNorm (running statistics), dropout, an in-place activation, a frozen layer, existing
    gradients (one of them None) and a submodule in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True),
                          nn.Dropout(0.5), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model[4].requires_grad_(False)
    model[5].eval()
    model(torch.randn(16, 4)).square().mean().backward()
    model[6].bias.grad = None
    return model


@pytest.mark.parametrize("method", sorted(PROFILERS))
def test_tuples_are_handed_to_the_next_layer_as_one_argument(method: str) -> None:
    model = _tuple_model()
    sample = (torch.randn(6, 4), torch.ones(6, 4))
    costs = PROFILERS[method](model, sample)
    assert len(costs) == len(model) and all(c >= 0 for c in costs)
    if method == "size":  # the layers with parameters keep (at least) parameters and gradients
        assert costs[1] >= 2 * 20 * 4 and costs[3] >= 2 * 20 * 4 and costs[6] >= 2 * 10 * 4
    balance = Pipe(model, method, stages=2, sample=sample).balance
    assert sum(balance) == len(model) and len(balance) == 2


@pytest.mark.parametrize("method", sorted(PROFILERS))
def test_profiling_leaves_the_model_as_it_was(method: str) -> None:
    model = _stateful_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_values = {n: g.clone() for n, g in grads.items() if g is not None}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    sample = torch.randn(16, 4)
    rng = torch.get_rng_state()
    PROFILERS[method](model, sample)
    after = model.state_dict()
    for key, value in state.items():  # running_mean, running_var, num_batches_tracked, weights
        assert torch.equal(after[key], value), key
    for name, p in model.named_parameters():
        assert p.grad is grads[name], f"{name}: .grad replaced"
        if p.grad is not None:
            assert torch.equal(p.grad, grad_values[name]), f"{name}: .grad changed"
        assert p.requires_grad == flags[name], name
    assert {n: m.training for n, m in model.named_modules()} == modes
    # The caller's random stream is untouched: seeding before Pipe(balance="time") and after
    # gives the same dropout masks.
    assert torch.equal(torch.get_rng_state(), rng)


def test_pipe_profiling_leaves_the_model_as_it_was() -> None:
    model = _stateful_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    Pipe(model, "time", stages=2, sample=torch.randn(16, 4))
    Pipe(model, "size", stages=2, sample=torch.randn(16, 4))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_layers_are_profiled_on_the_previous_layers_real_output() -> None:
    seen: list[torch.Size] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.shape)
            return x

    model = nn.Sequential(nn.Linear(3, 5), Spy(), nn.Linear(5, 7), Spy())
    layer_sizes(model, torch.randn(4, 3))
    assert seen == [torch.Size([4, 5]), torch.Size([4, 7])]


def test_sizes_count_parameters_gradients_and_saved_activations() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.Linear(10, 10),
                          nn.Linear(10, 10))
    sizes = layer_sizes(model, torch.randn(8, 100))
    # Linear(100, 100): weight + bias and their gradients (4 bytes each) plus its saved input.
    assert sizes[0] >= 2 * 10100 * 4 + 8 * 100 * 4
    assert sizes[0] > sizes[2] > sizes[3] > 0
    assert sizes[1] > 0  # ReLU keeps its output for the backward


def test_balance_by_params_and_size() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.Linear(10, 10),
                          nn.Linear(10, 10))
    assert layer_params(model) == [10100.0, 0.0, 1010.0, 110.0, 110.0]
    # [1, 4] and [2, 3] both peak at 10100; ties keep the last stage (it computes the loss) short.
    assert balance_by_params(model, 2) == [2, 3]
    # The first layer outweighs the other four together: it gets a stage of its own.
    assert balance_by_size(model, torch.randn(8, 100), 2) == [1, 4]


def test_shared_parameters_are_counted_once() -> None:
    shared = nn.Linear(10, 10)
    assert layer_params(nn.Sequential(shared, nn.Tanh(), shared)) == [110.0, 0.0, 0.0]


def test_balance_by_time_puts_the_slow_layer_alone() -> None:
    model = nn.Sequential(nn.Linear(512, 512), *[nn.Linear(512, 512) for _ in range(3)],
                          nn.Linear(512, 2))
    model[0] = nn.Sequential(*[nn.Linear(512, 512) for _ in range(24)])  # ~24x the others
    assert balance_by_time(model, torch.randn(64, 512), 2, repeats=5)[0] == 1


def test_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"repeats must be >= 1 \(got 0\)"):
        layer_times(nn.Sequential(nn.Linear(2, 2)), torch.randn(1, 2), repeats=0)
