"""Saving and resuming training: bit-identical continuation for flushing schedules and 2BW."""

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pipeline import Pipe


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.3), nn.Tanh(), nn.Linear(12, 12),
                         nn.Dropout(0.3), nn.Linear(12, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(42)
    return [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(4)]


def _train(pipe: Pipe, opt: torch.optim.Optimizer,
           batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        pipe.step(x, y, nn.MSELoss())
        opt.step()


def _fresh(schedule: str, seed: int) -> tuple[Pipe, torch.optim.Optimizer]:
    pipe = Pipe(_model(seed), [3, 3], devices=["cpu", "cpu"], chunks=2, schedule=schedule,
                checkpoint="always")
    return pipe, torch.optim.Adam(pipe.parameters(), lr=0.01)


def _resumed(schedule: str, restore: Callable[[Pipe, dict], None]) -> list[torch.Tensor]:
    batches = _batches()
    torch.manual_seed(123)
    pipe, opt = _fresh(schedule, 0)
    _train(pipe, opt, batches[:2])
    saved = copy.deepcopy({"pipe": pipe.training_state(), "optimizer": opt.state_dict()})
    pipe.close()
    torch.manual_seed(999)  # another process, another random state, other initial weights
    pipe, opt = _fresh(schedule, 5)
    restore(pipe, saved["pipe"])
    opt.load_state_dict(saved["optimizer"])
    _train(pipe, opt, batches[2:])
    return [p.detach().clone() for p in pipe.parameters()]


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_resume_from_training_state_is_bit_identical(schedule: str) -> None:
    batches = _batches()
    torch.manual_seed(123)
    pipe, opt = _fresh(schedule, 0)
    _train(pipe, opt, batches)
    expected = [p.detach().clone() for p in pipe.parameters()]
    resumed = _resumed(schedule, Pipe.load_training_state)
    for a, b in zip(resumed, expected, strict=True):
        assert torch.equal(a, b)
    # What the training state adds: weights alone (and no random state) resume differently.
    weights_only = _resumed(schedule, lambda p, s: p.load_state_dict(s["model"]))
    assert not all(torch.equal(a, b) for a, b in zip(weights_only, expected, strict=True))


def test_2bw_resume_needs_the_previous_weights() -> None:
    batches = _batches()
    torch.manual_seed(123)
    pipe, opt = _fresh("2bw", 0)
    _train(pipe, opt, batches)
    expected = [p.detach().clone() for p in pipe.parameters()]

    def without_versions(p: Pipe, s: dict) -> None:
        p.load_training_state({**s, "weight_versions": {}})

    resumed = _resumed("2bw", without_versions)
    assert not all(torch.equal(a, b) for a, b in zip(resumed, expected, strict=True))


def test_load_training_state_rejects_what_is_not_one() -> None:
    pipe, _ = _fresh("1f1b", 0)
    with pytest.raises(ValueError, match=r"lacks \['rng_cpu', 'rng_cuda', 'weight_versions'\]"):
        pipe.load_training_state({"model": pipe.state_dict()})
    state = pipe.training_state()
    state["weight_versions"] = {7: {}}
    with pytest.raises(ValueError, match="stages \\[7\\]"):
        pipe.load_training_state(state)
