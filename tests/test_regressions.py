"""Regressions: one test per bug fixed, named for the behaviour it restores.

Each test failed on the code before its fix; the error it raised then is in its docstring.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.splitting.profile import layer_sizes, layer_times


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


def _two_stage(*layers: nn.Module, **kwargs: object) -> Pipe:
    return Pipe(nn.Sequential(*layers), [1, len(layers) - 1], devices=["cpu", "cpu"],
                chunks=2, **kwargs)  # type: ignore[arg-type]


def test_an_input_that_requires_grad_gets_its_gradient() -> None:
    """Was: `x.grad` stayed None (stage 0 detached its inputs)."""
    torch.manual_seed(0)
    pipe = _two_stage(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(4, 3, requires_grad=True)
    pipe.step(x, torch.zeros(4, 1), nn.MSELoss())
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_one_tuple_stays_a_one_tuple_across_a_stage_boundary() -> None:
    """Was: the next stage got the bare tensor, so `t[0]` silently took the first row."""

    class Wrap(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x,)

    class First(nn.Module):
        def forward(self, t: tuple[torch.Tensor]) -> torch.Tensor:
            return t[0]

    x = torch.randn(4, 3)
    assert _two_stage(Wrap(), First())(x).shape == (4, 3)


def test_an_inplace_activation_can_open_a_stage() -> None:
    """Was: RuntimeError (a leaf Variable that requires grad is being used in an in-place
    operation) from the second stage's ReLU(inplace=True)."""
    pipe = _two_stage(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 1))
    assert torch.isfinite(pipe.step(torch.randn(4, 3), torch.zeros(4, 1), nn.MSELoss()))


def test_a_module_used_twice_in_a_stage_gets_one_gradient_under_2bw() -> None:
    """Was: twice the gradient: functional_call left the second use on the live parameter."""
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    pipe = _two_stage(nn.Linear(3, 3), shared, shared, schedule="2bw")
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    pipe.step(x, y, nn.MSELoss())
    got = shared.weight.grad.clone()
    shared.weight.grad = None
    model = pipe.__dict__["_full_model"]
    nn.MSELoss()(model(x), y).backward()
    torch.testing.assert_close(got, shared.weight.grad, rtol=1e-5, atol=1e-6)


def test_pipe_output_under_autocast_has_the_autocast_dtype() -> None:
    """Was: float32: autocast is thread-local and the rank threads never saw it."""
    pipe = _two_stage(nn.Linear(3, 3), nn.Linear(3, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pipe(torch.randn(4, 3)).dtype == torch.bfloat16


def test_torch_is_a_declared_dependency_installed_after_the_pinned_build() -> None:
    """Was: torch only in an optional `torch` extra, so `pip install pipeline-engine` gave a
    package whose `pipeline` and `benchmarks` failed at import (ModuleNotFoundError: torch)."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
    assert names["torch"] == "torch>=2.5"
    assert {"numpy", "tqdm"} <= set(names)
    # The Makefile installs its pinned CPU build first, so this range never pulls CUDA torch.
    install = (root / "Makefile").read_text()
    assert install.index("pip install -q $(TORCH_PIN)") < install.index("pip install -q -e")


def test_an_optimizer_on_the_models_parameters_trains_a_tied_model_exactly() -> None:
    """Was: the tie's copy is an extra Parameter of the model (53 instead of 52 here), and
    nothing said what an optimizer holding it does. It never has a gradient when the optimizer
    steps (its gradient is added to the owner's), so AdamW's weight decay and torch's
    clip_grad_norm_ leave it alone and training equals the plain model's; `close()` ties the
    weight again."""
    from tests.models import lm_loss, tiny_lm
    from tests.pipeline.parallel.test_ties import _batch

    reference = tiny_lm(dropout=0.0)
    model = tiny_lm(dropout=0.0)
    count = len(list(model.parameters()))
    pipe = Pipe(model, [3, 4], devices=["cpu", "cpu"], chunks=3)
    assert len(list(model.parameters())) == count + 1  # the copy, documented
    assert len(list(pipe.parameters())) == count
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for t in range(3):
        x, y = _batch(t)
        optimizer.zero_grad(set_to_none=False)
        plain.zero_grad(set_to_none=False)
        loss = pipe.step(x, y, lm_loss)
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        expected = lm_loss(reference(x), y)
        expected.backward()
        want = nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=1e-6)
        optimizer.step()
        plain.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6,
                                   msg=key)
    pipe.close()
    assert model[-1].weight is model[0].wte.weight  # tied again, with the trained value
    assert len(list(model.parameters())) == count
    torch.testing.assert_close(model[-1].weight, reference[-1].weight, rtol=1e-5, atol=1e-6)


def test_a_batch_smaller_than_chunks_is_a_pipe_config_error_and_inference_takes_chunks() -> None:
    """Was: MicroBatchError, a ValueError but not a PipeConfigError like every other bad input,
    and `pipe(x)` could not run a batch smaller than the Pipe's chunks."""
    from pipeline import PipeConfigError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = Pipe(model, [2, 1], devices=["cpu", "cpu"], chunks=4)
    with pytest.raises(PipeConfigError, match=r"cannot split a batch of 2 rows into 4 "
                                              r"micro-batches.*pipe\(x, chunks=2\)"):
        pipe(torch.randn(2, 3))
    with pytest.raises(PipeConfigError, match="cannot split a batch of 2 rows"):
        pipe.step(torch.randn(2, 3), torch.randn(2, 2), nn.MSELoss())
    x = torch.randn(2, 3)
    for chunks in (1, 2):
        torch.testing.assert_close(pipe(x, chunks=chunks), model(x))
    with pytest.raises(PipeConfigError, match=r"chunks must be >= 1 \(got 0\)"):
        pipe(x, chunks=0)
    pipe.close()
