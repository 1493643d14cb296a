"""A model's own loss (`labels=` in the inputs, `loss_fn=lambda out, y: out.loss`) trains exactly
without `loss_weight=`: each micro-batch is weighted by what the graph's loss divides by, counted
from the inputs by the graph's own ops (a causal LM's shift included), over the whole batch.

Micro-batches of 2 rows (chunks=4 on 8 rows) count 22, 2, 0 and 22 shifted tokens: weighting
them by rows is off by a third and more, and the micro-batch counting nothing has a 0/0 loss.
Tolerance: fp32, the same sums in another order (rtol 1e-5, atol 1e-6 for values zero in
exact arithmetic), as tests/models_traced.py's `assert_same_training`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe, PipeConfigError
from tests.models_traced import Case, exports_reused, gpt2_case, llama_case

pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-6}
CASES = {"llama": llama_case, "gpt2": gpt2_case}


def model_loss(out: Any, target: Any) -> torch.Tensor:
    """What Hugging Face's model cards and its Trainer use: the model's own loss."""
    return out.loss


@pytest.fixture(autouse=True, scope="module")
def _reuse_exports() -> Iterator[None]:
    with exports_reused():
        yield


def _with_labels(case: Case) -> dict[str, Any]:
    return {**case.inputs, "labels": case.labels}


def _assert_as_the_model(pipe: Pipe, model: nn.Module, reference: nn.Module, inputs: Any,
                         loss: torch.Tensor, what: str) -> None:
    want = reference(**inputs).loss
    want.backward()
    torch.testing.assert_close(loss, want.detach(), **TOL, msg=lambda m: f"{what}: loss: {m}")
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL,
                                   msg=lambda m, n=name: f"{what}: grad {n}: {m}")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_models_own_loss_is_exact_without_loss_weight(name: str, schedule: str) -> None:
    """Two accumulating steps: the target given as the labels, then as None (the loss reads
    the labels from the inputs); no warning, loss and every gradient as the unsplit model's."""
    case = CASES[name]()
    model = case.model()
    reference = copy.deepcopy(model)
    inputs = _with_labels(case)
    pipe = Pipe(model, example_inputs=inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4, schedule=schedule)
    try:
        for target in (case.labels, None):
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*loss_weight.*")
                loss = pipe.step(inputs, target, model_loss)
            given = "None" if target is None else "labels"
            _assert_as_the_model(pipe, model, reference, inputs, loss,
                                 f"{name}/{schedule}/target {given}")
    finally:
        pipe.close()


class _Penalised(nn.Module):
    """A token mean plus a row mean of the logits: no weighting of micro-batches makes it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(ids)))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + (logits ** 2).mean()
        return {"logits": logits, "loss": loss}


def test_a_loss_the_graph_cannot_weigh_still_warns() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (4, 6))
    labels = ids.clone()
    labels[2:, 2:] = -100
    inputs = {"ids": ids, "labels": labels}
    pipe = Pipe(_Penalised(), example_inputs=inputs, split_points=["head"],
                devices=["cpu", "cpu"], chunks=2)
    try:
        with pytest.warns(UserWarning, match="loss_weight"):
            pipe.step(inputs, labels, lambda out, y: out["loss"])
    finally:
        pipe.close()


def test_a_loss_fn_that_is_not_the_models_loss_is_weighed_as_before() -> None:
    """A loss of the logits (not the model's own 0-dim output) keeps today's rule: rows, and
    the warning, unless `loss_weight=` says what it averages over."""
    case = gpt2_case()
    inputs = _with_labels(case)
    pipe = Pipe(case.model(), example_inputs=inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4)
    try:
        with pytest.warns(UserWarning, match="loss_weight"):
            pipe.step(inputs, case.labels, case.loss)
        with pytest.raises(PipeConfigError, match="pass target"):
            pipe.step(inputs, None, case.loss)
    finally:
        pipe.close()


def test_num_items_in_batch_in_the_inputs_adds_micro_batch_sums() -> None:
    """Hugging Face's Trainer way: `num_items_in_batch` (the batch's shifted count) among the
    inputs makes the model's loss a sum over that count; the graph says so and the
    micro-batches' losses add up as they are: the unsplit model's mean, exactly."""
    case = llama_case()
    model = case.model()
    reference = copy.deepcopy(model)
    count = (case.labels[:, 1:] != -100).sum()
    inputs = {**_with_labels(case), "num_items_in_batch": count}
    pipe = Pipe(model, example_inputs=inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*loss_weight.*")
            loss = pipe.step(inputs, None, model_loss)
        _assert_as_the_model(pipe, model, reference, _with_labels(case), loss,
                             "num_items_in_batch")
    finally:
        pipe.close()


class _RowMean(nn.Module):
    """A model whose own loss is a mean over rows of its output (a regression head's)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.b(torch.tanh(self.a(x)))
        return out, F.mse_loss(out, y)


def test_a_row_mean_loss_of_the_model_is_weighted_by_rows_target_none() -> None:
    """8 rows in 3 micro-batches (3, 3, 2): the model's own mean over rows, target None."""
    torch.manual_seed(0)
    model = _RowMean()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    pipe = Pipe(model, example_inputs=(x, y), split_points=["b"], devices=["cpu", "cpu"],
                chunks=3)
    try:
        loss = pipe.step((x, y), None, lambda out, _: out[1])
        want = reference(x, y)[1]
        want.backward()
        torch.testing.assert_close(loss, want.detach(), **TOL)
        ref = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, **TOL)
    finally:
        pipe.close()


def test_the_last_stage_without_the_inputs_is_told_to_pass_them() -> None:
    """A process holding only the last stage counts the model's loss from the inputs: x None
    there is refused before any work, naming the rule."""
    from types import SimpleNamespace

    from pipeline.runtime import batches, weighting

    how = weighting.Weighting(True, len, False, model_loss=True, from_inputs=lambda part: 1.0)
    rank = SimpleNamespace(balance=[1, 1], world=(1, 2), local_stages={1})
    with pytest.raises(PipeConfigError, match=r"rank 1 holds the last stage.*pass x"):
        batches.share(rank, None, None, model_loss, 2, how)


def test_a_single_process_without_target_is_told_what_to_pass_not_a_rank() -> None:
    """A single-process Pipe whose loss reads the target was refused with "rank None holds the
    last stage": there is no rank in one process."""
    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2)
    with pytest.raises(PipeConfigError, match=r"^the last stage computes the loss from the "
                                              r"target: pass target") as caught:
        pipe.step(torch.randn(4, 4), None, nn.MSELoss())
    assert "rank" not in str(caught.value)
    pipe.close()


def test_a_models_own_loss_no_weighting_reproduces_is_exact_in_one_micro_batch() -> None:
    """A dict-returning model whose loss adds a token mean and a row mean: no weighting of
    micro-batches makes it, and without a target it was refused as "rank None ... pass
    target", which passing a target does not make exact. Now the refusal names the output and
    the fixes, and in one micro-batch (chunks=1) it trains exactly without a target."""
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[2:, 2:] = -100
    inputs = {"ids": ids, "labels": labels}
    pipe = Pipe(_Penalised(), example_inputs=inputs, split_points=["head"],
                devices=["cpu", "cpu"], chunks=2)
    try:
        with pytest.raises(PipeConfigError, match=r"^loss_fn returns the model's own "
                                                  r"output\['loss'\].*no weighting.*chunks=1.*"
                                                  r"loss_weight=") as caught:
            pipe.step(inputs, None, lambda out, y: out["loss"])
        assert "rank" not in str(caught.value)
    finally:
        pipe.close()
    torch.manual_seed(0)
    model = _Penalised()
    reference = copy.deepcopy(model)
    pipe = Pipe(model, example_inputs=inputs, split_points=["head"], devices=["cpu", "cpu"],
                chunks=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # exact: nothing to warn about
            loss = pipe.step(inputs, None, lambda out, y: out["loss"])
    finally:
        pipe.close()
    expected = reference(**inputs)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_a_load_balancing_loss_warns_what_is_exact_and_what_to_do() -> None:
    """Mixtral with output_router_logits=True adds its load-balancing loss (a product of two
    means over the batch's tokens) to `out.loss`. The warning said loss_weight= would make it
    right, which it cannot: it says what is exact (the token mean) and what is not, and the
    ways out."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[2:, 5:] = -100
    inputs = {"input_ids": ids, "labels": labels, "use_cache": False}
    pipe = Pipe(model, example_inputs=inputs, split_points=["model.layers.1"],
                devices=["cpu", "cpu"], chunks=2)
    try:
        with pytest.warns(UserWarning, match=r"aux_loss.*per micro-batch.*chunks=1.*"
                                             r"output_router_logits=False") as got:
            pipe.step(inputs, labels, model_loss)
        assert not any("Pass loss_weight=lambda target" in str(w.message) for w in got)
        with pytest.raises(PipeConfigError, match=r"output_router_logits=False"):
            pipe.step(inputs, None, model_loss)
    finally:
        pipe.close()
