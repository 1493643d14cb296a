"""Regressions: one test per bug fixed, named for the behaviour it restores.

Each test failed on the code before its fix; the error it raised then is in its docstring.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline import Pipe
from pipeline.profile import layer_sizes, layer_times


def test_profiling_hands_a_layers_tuple_to_the_next_layer_as_one_argument() -> None:
    """Was: TypeError (forward() takes 2 positional arguments but 3 were given): the profiler
    called `layer(*outputs)` where nn.Sequential calls `layer(outputs)`."""

    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, -x

    class Join(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] * pair[1]

    model = nn.Sequential(nn.Linear(3, 3), Split(), Join(), nn.Linear(3, 1))
    assert len(layer_sizes(model, torch.randn(4, 3))) == 4
    assert sum(Pipe(model, "time", stages=2, sample=torch.randn(4, 3)).balance) == len(model)


def test_profiling_leaves_batchnorm_statistics_and_gradients_as_they_were() -> None:
    """Was: running_mean, running_var and num_batches_tracked advanced by every profiled
    forward, and every existing `.grad` set to None."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model(torch.randn(8, 3)).sum().backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    layer_times(model, torch.randn(8, 3), repeats=1)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert all(p.grad is not None and torch.equal(p.grad, g)
               for p, g in zip(model.parameters(), grads, strict=True))


def test_profiling_runs_in_place_activations() -> None:
    """Was: RuntimeError (a leaf Variable that requires grad is being used in an in-place
    operation): each layer's input was a bare leaf, so ReLU(inplace=True) could not be timed."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    assert len(layer_times(model, torch.randn(8, 3), repeats=1)) == 3
    assert Pipe(model, "size", stages=2, sample=torch.randn(8, 3)).balance in ([1, 2], [2, 1])
