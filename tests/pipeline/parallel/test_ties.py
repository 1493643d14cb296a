"""Weights tied across stages: a language model's embedding and head, in threads and processes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import schedules
from pipeline import Pipe
from tests.models import lm_loss, tiny_lm

VOCAB, CONTEXT = 13, 8


def _batch(seed: int, rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, CONTEXT + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _plain_steps(model: nn.Sequential, steps: int, chunks: int) -> list[float]:
    """The reference: the plain model, dropout drawn as the Pipe draws it is not comparable,
    so tests with dropout run it at p=0 (tiny_lm(dropout=0.0))."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for t in range(steps):
        x, y = _batch(t)
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _pipe_steps(pipe: Pipe, model: nn.Sequential, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for t in range(steps):
        x, y = _batch(t)
        optimizer.zero_grad()
        losses.append(pipe.step(x, y, lm_loss).item())
        optimizer.step()
    return losses


def _compare(pipe: Pipe, reference: nn.Sequential) -> None:
    got = pipe.state_dict()
    for key, want in reference.state_dict().items():
        # fp32 in another summation order (micro-batches, the tie's two gradients), through
        # three AdamW steps whose first update is about lr * sign(g): 1e-5 relative.
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-5, msg=key)


def test_the_tie_is_found_and_refused_nowhere() -> None:
    model = tiny_lm(dropout=0.0)
    assert model[-1].weight is model[0].wte.weight
    pipe = Pipe(model, balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    names = [n for n, _ in pipe.named_parameters()]
    assert "0.wte.weight" in names and "6.weight" not in names  # counted once
    assert set(pipe.state_dict()) == set(tiny_lm(dropout=0.0).state_dict())  # both keys
    pipe.close()


# Every registered schedule (2BW has its own rule, below), every checkpoint mode.
CASES = [(name, mode) for name in schedules.available() if not schedules.info(name).multi_batch
         for mode in ("never", "except_last", "always")]


@pytest.mark.parametrize(("schedule", "checkpoint"), CASES)
def test_tied_model_equals_the_plain_model_over_three_steps(schedule: str,
                                                            checkpoint: str) -> None:
    reference = tiny_lm(dropout=0.0)
    model = copy.deepcopy(reference)
    two_per_rank = schedules.info(schedule).stages_per_rank == 2
    balance = [2, 2, 1, 2] if two_per_rank else [3, 4]
    pipe = Pipe(model, balance=balance, devices=["cpu", "cpu"], chunks=3, schedule=schedule,
                checkpoint=checkpoint)
    want = _plain_steps(reference, 3, 3)
    got = _pipe_steps(pipe, model, 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    _compare(pipe, reference)
    pipe.close()


def test_tied_gradient_is_the_sum_of_both_uses_and_left_on_the_owner() -> None:
    reference = tiny_lm(dropout=0.0)
    model = copy.deepcopy(reference)
    pipe = Pipe(model, balance=[3, 4], devices=["cpu", "cpu"], chunks=4)
    x, y = _batch(0)
    lm_loss(reference(x), y).backward()
    pipe.step(x, y, lm_loss)
    torch.testing.assert_close(model[0].wte.weight.grad, reference[0].wte.weight.grad,
                               rtol=1e-5, atol=1e-7)
    assert model[-1].weight is not model[0].wte.weight and model[-1].weight.grad is None
    pipe.close()


def test_a_state_dict_shows_the_owners_value_after_the_optimizer_step() -> None:
    model = tiny_lm(dropout=0.0)
    pipe = Pipe(model, balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    x, y = _batch(1)
    pipe.step(x, y, lm_loss)
    optimizer.step()
    for state in (pipe.state_dict(), model.state_dict()):
        assert torch.equal(state["6.weight"], state["0.wte.weight"])
    plain = tiny_lm(dropout=0.0)
    plain.load_state_dict(pipe.state_dict())
    assert plain[-1].weight is plain[0].wte.weight
    pipe.close()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_tied_model_across_processes(nproc: int) -> None:
    from pipeline.launch import spawn
    from tests.limits import SPAWN_TIMEOUT
    from tests.pipeline import dist_workers

    split = {2: [3, 4], 3: [2, 3, 2]}[nproc]
    combos = [("1f1b", "except_last", split), ("gpipe", "always", split),
              ("zb-h1", "never", split)]
    if nproc == 2:
        combos += [("zb-v", "always", [2, 2, 1, 2]), ("interleaved", "never", [2, 2, 1, 2])]
    assert spawn(dist_workers.tied_language_model, nproc, combos,
                 timeout=SPAWN_TIMEOUT) == [len(combos)] * nproc


@pytest.mark.parametrize("many", [False, True])
def test_2bw_with_a_tied_weight_follows_the_stale_update_rule(many: bool) -> None:
    from tests.pipeline.test_pipe import _two_bw_reference

    reference = tiny_lm(dropout=0.0)
    model = copy.deepcopy(reference)
    data, lr = [_batch(t) for t in range(3)], 0.5
    expected = _two_bw_reference(reference, data, lr, lm_loss)
    pipe = Pipe(model, balance=[3, 4], devices=["cpu", "cpu"], chunks=2, schedule="2bw")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)
    if many:
        losses = [v.item() for v in pipe.step_many(data, lm_loss, optimizer)]
    else:
        losses = []
        for x, y in data:
            optimizer.zero_grad()
            losses.append(pipe.step(x, y, lm_loss).item())
            optimizer.step()
    assert losses == pytest.approx(expected, rel=1e-5)
    _compare(pipe, reference)
    pipe.close()


def test_a_tied_model_built_on_meta_initialises_the_owner_and_fills_the_copy() -> None:
    with torch.device("meta"):
        model = tiny_lm(dropout=0.0)
    pipe = Pipe(model, balance=[3, 4], devices=["cpu", "cpu"], chunks=2)  # Head: no initialiser
    x, y = _batch(0)
    assert torch.isfinite(pipe.step(x, y, lm_loss))
    owner, copy_ = model[0].wte.weight, model[-1].weight
    assert not owner.is_meta and torch.equal(copy_, owner) and copy_ is not owner
    pipe.close()


def test_a_tied_model_saves_sharded_and_loads_into_the_plain_model(tmp_path: Any) -> None:
    from pipeline.state import sharded

    model = tiny_lm(dropout=0.0)
    pipe = Pipe(model, balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    x, y = _batch(0)
    pipe.step(x, y, lm_loss)
    optimizer.step()
    pipe.save(tmp_path / "ckpt", optimizer)
    plain = tiny_lm(dropout=0.0, seed=5)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    sharded.load(plain, tmp_path / "ckpt", plain_opt)
    assert plain[-1].weight is plain[0].wte.weight
    for key, value in pipe.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    again = Pipe(tiny_lm(dropout=0.0, seed=6), balance=[2, 5], devices=["cpu", "cpu"])
    again_opt = torch.optim.Adam(again.parameters(), lr=1e-2)
    again.load(tmp_path / "ckpt", again_opt)
    for key, value in pipe.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert again_opt.state_dict()["state"][0]["exp_avg"].equal(
        optimizer.state_dict()["state"][0]["exp_avg"])
    pipe.close()
    again.close()


@pytest.mark.parametrize(("schedule", "balance"), [("1f1b", [3, 4]), ("zb-v", [2, 2, 1, 2])])
def test_two_accumulating_steps_before_the_optimizer_step(schedule: str,
                                                          balance: list[int]) -> None:
    reference = tiny_lm(dropout=0.0)
    model = copy.deepcopy(reference)
    pipe = Pipe(model, balance=balance, devices=["cpu", "cpu"], chunks=2, schedule=schedule)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for t in range(3):
        optimizer.zero_grad()
        plain.zero_grad()
        for k in range(2):  # the copy's gradient adds onto the owner's accumulated one
            x, y = _batch(2 * t + k)
            pipe.step(x, y, lm_loss)
            lm_loss(reference(x), y).backward()
        optimizer.step()
        plain.step()
    _compare(pipe, reference)
    pipe.close()
