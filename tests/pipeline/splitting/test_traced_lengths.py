"""Batches of any length through stages split from a model's graph: Hugging Face models
captured at one length train and infer at others exactly as the unsplit model, under every
schedule family; a model whose code fixes a length is captured again (counted); packed rows
train exactly; a length the model cannot take is refused before any work."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe, PipeConfigError
from tests.models_lengths import CAPTURED, POSITIONS, batch, length_case, packed
from tests.models_traced import token_count, token_loss

pytest.importorskip("transformers")

# fp32, the same ops in another summation order (micro-batches): rtol 1e-5; atol 1e-6 for
# values that are zero in exact arithmetic (BERT's attention key biases: softmax ignores them).
TOL = {"rtol": 1e-5, "atol": 1e-6}
LENGTHS = [16, 8, 7]  # longer, shorter, odd than the captured 12


def _same_step(pipe: Pipe, model: nn.Module, reference: nn.Module, inputs: dict[str, Any],
               labels: torch.Tensor, what: str) -> None:
    """One step of `pipe` and one of the unsplit `reference`: equal loss and gradients."""
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    loss = pipe.step(inputs, labels, token_loss, loss_weight=token_count)
    expected = token_loss(reference(**inputs), labels)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL, msg=lambda m: f"{what}: {m}")
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (want[name].grad is None), (what, name)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, want[name].grad, **TOL,
                                       msg=lambda m, n=name: f"{what}, {n}: {m}")


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_trains_and_infers_at_lengths_it_was_not_captured_at(name: str) -> None:
    """Captured at 12 tokens, trained at 16, 8 and 7 (and 12 again), then inference at 20:
    every loss and gradient equal the unsplit model's, from the one capture (every
    dimension symbolic: no capture again)."""
    case = length_case(name)
    model, reference = case.model(), case.model()
    pipe = Pipe(model, example_inputs=case.inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4, schedule="1f1b")
    try:
        for seed, length in enumerate([*LENGTHS, CAPTURED]):
            inputs, labels = batch(name, length, seed=seed + 1)
            _same_step(pipe, model, reference, inputs, labels, f"{name} at {length}")
        inputs, _ = batch(name, 20, rows=6, seed=9)
        model.eval()
        reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(pipe(inputs).logits, reference(**inputs).logits,
                                       **TOL)
        assert pipe._io.lengths.captures == 1
    finally:
        pipe.close()


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved", "zb-h1", "zb-v"])
def test_every_schedule_family_takes_any_length(schedule: str) -> None:
    """Llama under each schedule family (two stages per device for interleaved and zb-v),
    the checkpoint modes turning: lengths 16 and 7 train as the unsplit model."""
    case = length_case("llama")
    model, reference = case.model(), case.model()
    two = schedule in ("interleaved", "zb-v")
    checkpoint = {"gpipe": "always", "interleaved": "never"}.get(schedule, "except_last")
    pipe = Pipe(model, example_inputs=case.inputs,
                split_points=case.blocks[1:] if two else [case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4, schedule=schedule, checkpoint=checkpoint)
    try:
        for seed, length in enumerate([16, 7]):
            inputs, labels = batch("llama", length, seed=seed + 1)
            _same_step(pipe, model, reference, inputs, labels, f"{schedule} at {length}")
    finally:
        pipe.close()


def test_step_many_takes_a_length_per_batch() -> None:
    """`step_many` over batches of 16, 7 and 12 tokens: the weights after AdamW on each
    equal the unsplit model's after the same steps."""
    case = length_case("gpt2")
    model, reference = case.model(), case.model()
    pipe = Pipe(model, example_inputs=case.inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=2, schedule="zb-h1")
    batches = [batch("gpt2", n, seed=s) for s, n in enumerate([16, 7, 12])]
    try:
        losses = pipe.step_many(batches, token_loss,
                                torch.optim.AdamW(model.parameters(), lr=1e-3),
                                loss_weight=token_count)
    finally:
        pipe.close()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for (inputs, labels), loss in zip(batches, losses, strict=True):
        expected = token_loss(reference(**inputs), labels)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, expected.detach(), **TOL)
    want = reference.state_dict()
    for key, value in model.state_dict().items():
        # AdamW moves a weight by lr x g / (|g| + eps): rounding-noise gradients by ~1e-7
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-5, msg=key)


class _Branching(nn.Module):
    """Code that branches on the sequence length (as some models pick a kernel or a window
    by it): export can keep the length symbolic only on one side of the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if h.shape[1] > 8:  # a window over long sequences: every other position halved
            h = h * torch.where(torch.arange(h.shape[1]) % 2 == 0, 1.0, 0.5)[:, None]
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h).mean(1)


def test_a_length_its_code_branches_on_is_captured_again_once_per_family() -> None:
    """Captured at 12 (the long branch), a batch of 6 takes the other: the model is captured
    again (2 captures) and trains as the unsplit model; 5, 16 and 6 again need no further
    capture (each fits one of the two)."""
    torch.manual_seed(0)
    model = _Branching()
    reference = copy.deepcopy(model)
    pipe = Pipe(model, example_inputs=torch.randn(8, 12, 4), split_points=["blocks.1"],
                devices=["cpu", "cpu"], chunks=4)
    loss_fn = nn.MSELoss()
    try:
        for length, captures in [(12, 1), (6, 2), (5, 2), (16, 2), (6, 2)]:
            x, y = torch.randn(8, length, 4), torch.randn(8, 2)
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            loss = pipe.step(x, y, loss_fn)
            expected = loss_fn(reference(x), y)
            expected.backward()
            torch.testing.assert_close(loss, expected.detach(), **TOL)
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, **TOL)
            assert pipe._io.lengths.captures == captures, length
    finally:
        pipe.close()


def test_packed_rows_train_as_the_unsplit_model() -> None:
    """Rows packing several documents, position_ids restarting at each (no attention mask):
    Llama derives each document's causal mask from the position_ids inside the graph, and
    that mask crosses the cut like any value. Captured on one packing, trained on others
    (other lengths too): exact, and each document attends only to itself (a document alone
    gives the same logits as packed)."""
    case = length_case("llama")
    model, reference = case.model(), case.model()
    inputs, _ = packed([[5, 7], [12], [3, 4, 5], [6, 6]])
    pipe = Pipe(model, example_inputs=inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4, schedule="1f1b")
    try:
        for seed, docs in enumerate([[[9, 4, 7], [20], [1, 2, 17], [10, 10]],
                                     [[3, 4], [7], [2, 5], [1, 1, 5]]]):
            inputs, labels = packed(docs, seed=seed + 1)
            _same_step(pipe, model, reference, inputs, labels, f"packed {docs}")
        inputs, _ = packed([[9, 4, 7], [20], [1, 2, 17], [10, 10]], seed=5)
        model.eval()
        with torch.no_grad():
            got = pipe(inputs).logits
            alone = reference(input_ids=inputs["input_ids"][:1, 9:13], use_cache=False).logits
        torch.testing.assert_close(got[:1, 9:13], alone, **TOL)
    finally:
        pipe.close()


def _refused(name: str, inputs: dict[str, Any], labels: torch.Tensor, match: str) -> None:
    """Pipe over `name` captured at 12 refuses a step on `inputs`, before any work: no
    gradient anywhere, the weights as they were."""
    case = length_case(name)
    model = case.model()
    pipe = Pipe(model, example_inputs=case.inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4)
    before = copy.deepcopy(model.state_dict())
    try:
        with pytest.raises(PipeConfigError, match=match):
            pipe.step(inputs, labels, token_loss, loss_weight=token_count)
        assert all(p.grad is None for p in model.parameters())
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key
        assert pipe._io.lengths.captures == 1
    finally:
        pipe.close()


def test_a_length_past_a_learned_position_table_is_refused_before_any_work() -> None:
    """GPT-2's position table has 32 rows: 40 tokens would index past it (the unsplit model
    fails with IndexError in its forward). Refused, naming the input, the dimension, the
    size and the table, before any work."""
    inputs, labels = batch("gpt2", POSITIONS + 8)
    _refused("gpt2", inputs, labels,
             r"input 'input_ids' has size 40 in dim 1.*positions below 32.*"
             r"transformer\.wpe\.weight.*truncate")


def test_a_length_past_the_models_guard_is_refused_before_any_work() -> None:
    """BERT's graph bounds its sequence by its 32 positions (a guard export recorded): 40
    tokens are captured again, which fails as the model does, and are refused."""
    inputs, labels = batch("bert", POSITIONS + 8)
    _refused("bert", inputs, labels,
             r"input 'input_ids' has size 40 in dim 1.*sizes 1 to 32.*fails")


def test_a_mask_of_another_length_than_the_ids_is_refused_before_any_work() -> None:
    """Llama's attention mask must be as long as its ids: a mask of 9 beside ids of 10 is
    refused, naming both."""
    inputs, labels = batch("llama", 10)
    inputs["attention_mask"] = inputs["attention_mask"][:, :9]
    _refused("llama", inputs, labels,
             r"input 'attention_mask' has size 9 in dim 1.*dim 1 of 'input_ids' \(10\)")
