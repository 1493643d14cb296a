"""Losses that do not weigh every row the same: ignored tokens, class weights, a user's measure.

A language model's loss averages over its counted (non-ignored) tokens, not over rows: with
padded labels the micro-batches hold different numbers of them, and weighting each micro-batch
by its rows trains silently wrong. These tests compare with the plain model on the whole batch.

Tolerance: the hypothesis test runs in float64 (rtol 1e-9 as in test_transparency: a wrongly
weighted micro-batch is off by 1e-2 or more); the fixed tests in fp32, rtol 1e-5 (sums of a
few micro-batches in another order, gradients O(0.1)).
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import schedules
from pipeline import Pipe, PipeConfigError
from tests.models import ClassesFirst, FlattenTokens, lm_loss, tiny_lm
from tests.strategies import padded_labels

SCHEDULES = schedules.available()
MODES = ("never", "except_last", "always")
TOL = {"rtol": 1e-5, "atol": 1e-6}
VOCAB, CONTEXT = 13, 8


def _lm(head: nn.Module | None = None, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    model = tiny_lm(VOCAB, 16, depth=4, context=CONTEXT, dropout=0.0)
    if head is not None:
        model.append(head)
    return model.to(dtype)


def _ids(labels: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(labels.numel())
    return torch.randint(0, VOCAB, labels.shape, generator=g)


def _balance(schedule: str, num_layers: int) -> list[int]:
    stages = 2 * schedules.info(schedule).stages_per_rank
    return [num_layers // stages + (i < num_layers % stages) for i in range(stages)]


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach()


def _same_grads(pipe: Pipe, reference: nn.Module, tol: dict[str, float]) -> None:
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        assert (p.grad is None) == (ref[name].grad is None), name
        torch.testing.assert_close(p.grad, ref[name].grad, **tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _scaled(model: nn.Module, rtol: float) -> dict[str, float]:
    scale = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    return {"rtol": rtol, "atol": rtol * scale}


@settings(max_examples=40)
@given(labels=padded_labels(VOCAB, CONTEXT), schedule=st.sampled_from(SCHEDULES),
       checkpoint=st.sampled_from(MODES), chunks=st.integers(1, 4),
       smoothing=st.sampled_from([0.0, 0.1]), weighted=st.booleans())
def test_cross_entropy_with_ignored_tokens_equals_the_plain_model(
        labels: torch.Tensor, schedule: str, checkpoint: str, chunks: int, smoothing: float,
        weighted: bool) -> None:
    chunks = min(chunks, labels.shape[0])
    model = _lm(ClassesFirst(), torch.float64)
    reference = copy.deepcopy(model)
    weight = torch.linspace(0.5, 2.0, VOCAB, dtype=torch.float64) if weighted else None
    loss_fn = nn.CrossEntropyLoss(weight=weight, ignore_index=-100, label_smoothing=smoothing)
    pipe = Pipe(model, _balance(schedule, len(model)), chunks=chunks, schedule=schedule,
                checkpoint=checkpoint)
    x = _ids(labels)
    loss = pipe.step(x, labels, loss_fn)
    expected = _reference(reference, x, labels, loss_fn)
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=0.0)
    _same_grads(pipe, reference, _scaled(reference, 1e-9))
    pipe.close()


def _padded(rows: int = 6) -> torch.Tensor:
    """Labels with 8, 3, 0, 5, 8, 1 counted tokens: micro-batches of unequal token counts, and
    (with 3 chunks) a middle one whose second row is all padding."""
    labels = _ids(torch.zeros(rows, CONTEXT, dtype=torch.long))
    for r, n in enumerate([8, 3, 0, 5, 8, 1][:rows]):
        labels[r, n:] = -100
    return labels


def test_the_issue_reproduction_a_tied_gpt_with_padded_labels() -> None:
    """Before: 6.946512 against 6.940761 and gradients off by up to 1.68x, with no warning."""
    labels = _padded()
    model = _lm(ClassesFirst())
    reference = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()  # ignore_index=-100 by default
    pipe = Pipe(model, [4, 4], devices=["cpu", "cpu"], chunks=3)
    loss = pipe.step(_ids(labels), labels, loss_fn)
    torch.testing.assert_close(loss, _reference(reference, _ids(labels), labels, loss_fn), **TOL)
    _same_grads(pipe, reference, TOL)
    pipe.close()


@pytest.mark.parametrize("loss_fn", [
    F.cross_entropy,
    functools.partial(F.cross_entropy, ignore_index=-100, label_smoothing=0.1),
    nn.NLLLoss(),
    functools.partial(F.nll_loss, ignore_index=0),
], ids=["F.cross_entropy", "partial-smoothing", "NLLLoss", "partial-nll-ignore-0"])
def test_cross_entropy_and_nll_functions_and_modules_count_targets(
        loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
    labels = _padded()
    nll = loss_fn is F.nll_loss or isinstance(loss_fn, nn.NLLLoss) or (
        isinstance(loss_fn, functools.partial) and loss_fn.func is F.nll_loss)
    if nll:  # log-probabilities in, and ignored entries as the loss declares them
        head: nn.Module = nn.Sequential(nn.LogSoftmax(-1), ClassesFirst())
        labels = labels.clamp(min=0) if isinstance(loss_fn, functools.partial) else labels
    else:
        head = ClassesFirst()
    model = _lm(head)
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [4, 4], chunks=3, schedule="zb-h1")
    loss = pipe.step(_ids(labels), labels, loss_fn)
    torch.testing.assert_close(loss, _reference(reference, _ids(labels), labels, loss_fn), **TOL)
    _same_grads(pipe, reference, TOL)


def _token_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels != -100).sum()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-v"])
def test_a_plain_function_is_weighted_by_loss_weight(schedule: str) -> None:
    """The Hugging Face style: the model flattens tokens, the loss flattens the labels."""
    labels = _padded()
    model = _lm(FlattenTokens())
    reference = copy.deepcopy(model)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target.reshape(-1))

    pipe = Pipe(model, _balance(schedule, len(model)), chunks=3, schedule=schedule)
    loss = pipe.step(_ids(labels), labels, loss_fn, loss_weight=_token_count)
    torch.testing.assert_close(loss, _reference(reference, _ids(labels), labels, loss_fn), **TOL)
    _same_grads(pipe, reference, TOL)


def test_loss_weight_in_step_many_under_2bw() -> None:
    labels = _padded()
    model, reference = _lm(), _lm()
    pipe = Pipe(model, [3, 4], chunks=3, schedule="2bw")
    losses = pipe.step_many([(_ids(labels), labels)], lm_loss,
                            torch.optim.SGD(pipe.parameters(), lr=0.0),
                            loss_weight=_token_count)
    torch.testing.assert_close(losses[0], lm_loss(reference(_ids(labels)), labels).detach(),
                               **TOL)


def test_a_micro_batch_of_only_ignored_targets_adds_nothing() -> None:
    labels = _padded(4)
    labels[2:] = -100  # the second of two micro-batches counts no token: its mean is 0/0
    model = _lm(ClassesFirst())
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [4, 4], chunks=2, checkpoint="always")
    loss = pipe.step(_ids(labels), labels, nn.CrossEntropyLoss())
    expected = _reference(reference, _ids(labels), labels, nn.CrossEntropyLoss())
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected, **TOL)
    _same_grads(pipe, reference, TOL)


def test_a_batch_of_only_ignored_targets_is_nan_with_zero_gradients_as_in_torch() -> None:
    labels = torch.full((4, CONTEXT), -100)
    model = _lm(ClassesFirst())
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [4, 4], chunks=2)
    loss = pipe.step(_ids(labels), labels, nn.CrossEntropyLoss())
    expected = _reference(reference, _ids(labels), labels, nn.CrossEntropyLoss())
    assert torch.isnan(expected) and torch.isnan(loss)
    _same_grads(pipe, reference, {"rtol": 0.0, "atol": 0.0})
    assert all(p.grad is not None and not p.grad.any() for p in pipe.parameters())


def test_soft_targets_are_weighted_by_rows() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5))
    reference = copy.deepcopy(model)
    x, y = torch.randn(7, 4), torch.softmax(torch.randn(7, 5), -1)
    pipe = Pipe(model, [2, 1], chunks=3)
    loss = pipe.step(x, y, nn.CrossEntropyLoss(label_smoothing=0.05))
    torch.testing.assert_close(
        loss, _reference(reference, x, y, nn.CrossEntropyLoss(label_smoothing=0.05)), **TOL)
    _same_grads(pipe, reference, TOL)


def test_a_plain_function_on_padded_labels_without_loss_weight_warns() -> None:
    labels = _padded()
    pipe = Pipe(_lm(), [3, 4], chunks=3)
    with pytest.warns(UserWarning, match=r"-100.*loss_weight=lambda target: "
                                         r"\(target != -100\)\.sum\(\)"):
        pipe.step(_ids(labels), labels, lm_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per Pipe, and never when the weighting is said
        pipe.step(_ids(labels), labels, lm_loss)
        Pipe(_lm(), [3, 4], chunks=3).step(_ids(labels), labels, lm_loss,
                                           loss_weight=_token_count)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_weight": _token_count, "loss_reduction": "sum"},
     r"loss_weight= weighs micro-batch means.*reduces by 'sum'"),
    ({"loss_weight": 3}, r"loss_weight must be callable.*got 3"),
    ({"loss_weight": lambda t: -1.0}, r"loss_weight\(target\) must be a finite number >= 0 "
                                      r"\(got -1\.0 for micro-batch 0\)"),
    ({"loss_weight": lambda t: "many"}, r"loss_weight\(target\) must be a finite number"),
])
def test_bad_loss_weights_are_refused(kwargs: dict[str, Any], message: str) -> None:
    labels = _padded()
    pipe = Pipe(_lm(), [3, 4], chunks=3)
    with pytest.raises((PipeConfigError, TypeError), match=message):
        pipe.step(_ids(labels), labels, lm_loss, **kwargs)


def test_a_summing_cross_entropy_adds_micro_batch_sums() -> None:
    labels = _padded()
    model = _lm(ClassesFirst())
    reference = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    pipe = Pipe(model, [4, 4], chunks=3)
    loss = pipe.step(_ids(labels), labels, loss_fn)
    torch.testing.assert_close(loss, _reference(reference, _ids(labels), labels, loss_fn),
                               rtol=1e-5, atol=1e-4)  # a sum of 25 tokens' losses, O(60)
    _same_grads(pipe, reference, {"rtol": 1e-5, "atol": 1e-5})


# -- item: the target's rows are checked against the input's, not the output's ---------------

@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu"]])
def test_a_head_that_flattens_tokens_trains_with_its_reshaped_target(
        devices: list[str]) -> None:
    """Before: 'the last stage's output has 18 rows but its target has 3' for a model that
    trained exactly: the output's rows are the model's business."""
    labels = _ids(torch.zeros(6, CONTEXT, dtype=torch.long))
    model = _lm(FlattenTokens())
    reference = copy.deepcopy(model)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target.reshape(-1))

    balance = [4, 4] if len(devices) == 2 else [8]
    pipe = Pipe(model, balance, devices=devices, chunks=3)
    loss = pipe.step(_ids(labels), labels, loss_fn)
    torch.testing.assert_close(loss, _reference(reference, _ids(labels), labels, loss_fn), **TOL)
    _same_grads(pipe, reference, TOL)
    out = pipe(_ids(labels))  # inference merges the flattened outputs
    assert out.shape == (6 * CONTEXT, VOCAB)
