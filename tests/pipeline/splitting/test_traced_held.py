"""Models split from their graph as users hold them: 0-dim outputs of `pipe(x)` combined as the
batch's, `model.eval()` reaching the stages, keywords through `**kwargs` (Hugging Face's flags,
PEFT's LoRA, under every schedule family), and inputs broadcast over the batch. (A dtype changed
after the split: tests/pipeline/splitting/test_traced_dtypes.py.)"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import schedules
from pipeline import Pipe, PipeConfigError
from tests.models_traced import (
    LR,
    STEPS,
    Case,
    Record,
    assert_same_training,
    exports_reused,
    gpt2_case,
    llama_case,
    pipe_steps,
    reference_steps,
    unet_case,
)

LLAMA_CUT = ["model.layers.2"]


class _Regularised(nn.Module):
    """Returns its output and a 0-dim penalty on it, as a model with an auxiliary loss does."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.b(torch.tanh(self.a(x)))
        # A row mean (plus a constant), a sum, and a value the batch does not change.
        return out, (out ** 2).mean() + 0.5, out[:, 0].sum() * 2, self.a.weight.sum()


def test_a_0dim_output_is_the_batchs_not_the_first_micro_batchs() -> None:
    """8 rows in 3 micro-batches (3, 3, 2): the mean is weighted by rows, the sum added."""
    torch.manual_seed(0)
    model = _Regularised()
    x = torch.randn(8, 4)
    pipe = Pipe(model, example_inputs=(x,), split_points=["b"], devices=["cpu", "cpu"],
                chunks=3)
    try:
        got = pipe(x)
        with torch.no_grad():
            want = model(x)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    finally:
        pipe.close()


def test_llama_eval_loss_is_the_batchs_token_mean() -> None:
    """`labels=` with -100: Hugging Face's loss is a mean over the counted (shifted) tokens;
    micro-batches count 22, 2, 0 and 22 of them, one nothing at all (its mean is 0/0)."""
    case = llama_case()
    model = case.model()
    inputs = {**case.inputs, "labels": case.labels}
    pipe = Pipe(model, example_inputs=inputs, split_points=LLAMA_CUT,
                devices=["cpu", "cpu"], chunks=4)
    try:
        model.eval()
        got = pipe(inputs)
        with torch.no_grad():
            want = model(**inputs)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    finally:
        pipe.close()


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True))


def test_a_load_balancing_loss_is_refused_over_micro_batches_and_exact_in_one() -> None:
    """Mixtral's aux loss multiplies two means over the batch's tokens: no weighting of the
    micro-batches' values gives it, so `pipe(x)` says so (naming it) before any work."""
    model = _mixtral().eval()
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "use_cache": False}
    pipe = Pipe(model, example_inputs=inputs, split_points=["model.layers.1"],
                devices=["cpu", "cpu"], chunks=4)
    try:
        with pytest.raises(PipeConfigError, match=r"aux_loss.*chunks=1"):
            pipe(inputs)
        with pytest.raises(RuntimeError, match="no step has run"):
            pipe.last_timeline()  # refused before any work
        got = pipe(inputs, chunks=1)
        with torch.no_grad():
            want = model(**inputs)
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=0)
    finally:
        pipe.close()


def test_model_eval_reaches_the_traced_stages() -> None:
    """`model.eval()` (not only `pipe.eval()`) turns dropout off in `pipe(x)`, and
    `model.train()` back on; `pipe.eval()` puts the model in eval mode, as it does for an
    nn.Sequential's layers."""
    case = gpt2_case()
    model = case.model(dropout=0.3)
    pipe = Pipe(model, example_inputs=case.inputs, split_points=["transformer.h.2"],
                devices=["cpu", "cpu"], chunks=2)
    try:
        model.eval()
        with torch.no_grad():
            want = model(**case.inputs).logits
        torch.testing.assert_close(pipe(case.inputs).logits, want, rtol=1e-5, atol=1e-6)
        model.train()
        assert not torch.allclose(pipe(case.inputs).logits, want, rtol=1e-2, atol=1e-2)
        pipe.eval()
        assert not model.training and not any(m.training for m in model.modules())
        torch.testing.assert_close(pipe(case.inputs).logits, want, rtol=1e-5, atol=1e-6)
        pipe.train()
        assert model.training
    finally:
        pipe.close()


def test_model_eval_keeps_batchnorm_statistics_in_inference() -> None:
    """BatchNorm in eval mode normalises by its running statistics and leaves them."""
    case = unet_case()
    model = case.model()
    pipe = Pipe(model, example_inputs=case.inputs, split_points=["enc2", "dec2"],
                devices=["cpu", "cpu", "cpu"], chunks=4)
    try:
        model.eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        got = pipe(case.inputs)
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key
        with torch.no_grad():
            want = model(**case.inputs)
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
    finally:
        pipe.close()


def test_an_nn_sequential_follows_model_eval_too() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    x = torch.randn(8, 4)
    pipe = Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=2)
    try:
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), model(x))
    finally:
        pipe.close()


class _Keywords(nn.Module):
    """A forward taking everything after its first argument through `**kwargs`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = self.a(x) * kwargs["scale"]
        if kwargs.get("double"):
            h = h * 2
        return self.b(h)


def test_keywords_through_kwargs_split_and_train() -> None:
    torch.manual_seed(0)
    model = _Keywords()
    x, scale = torch.randn(8, 4), torch.rand(8, 1)
    inputs = ((x,), {"scale": scale, "double": True})
    pipe = Pipe(model, example_inputs=inputs, split_points=["b"], devices=["cpu", "cpu"],
                chunks=4)
    try:
        loss = pipe.step(inputs, torch.zeros(8, 4), nn.MSELoss())
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        want = nn.MSELoss()(model(x, scale=scale, double=True), torch.zeros(8, 4))
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
        for got, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-7)
    finally:
        pipe.close()


def _lora_case() -> Case:
    """Llama with LoRA adapters on its attention (PEFT), called with Hugging Face's flags
    that its forward takes through `**kwargs`."""
    peft = pytest.importorskip("peft")
    base = llama_case()

    def build(dropout: float) -> nn.Module:
        model = base.build(dropout)
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    inputs = {**base.inputs, "return_dict": True, "output_hidden_states": True}
    return Case("llama-lora", build, inputs, base.labels,
                [f"base_model.model.{b}" for b in base.blocks], base.loss)


def _stale_steps(case: Case) -> Record:
    """PipeDream-2BW's rule, as `pipe.step` under "2bw" follows it: step t's loss and
    gradients are taken at the weights before the previous update, W(t-1) (W(-1) = W(0)),
    and AdamW applies them to W(t)."""
    model = case.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    record = Record()
    previous = copy.deepcopy(model)
    for _ in range(STEPS):
        stale = copy.deepcopy(previous)  # W(t-1)
        loss = case.loss(stale(**case.inputs), case.labels)
        loss.backward()
        previous = copy.deepcopy(model)  # W(t), before its update
        for p, q in zip(model.parameters(), stale.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.clone()
        record.add(loss, model)
        optimizer.step()
        record.after_step(model)
    return record


# Every schedule family `schedules.available()` offers (zb-h1-tight is zb-h1 with a tighter
# memory bound: the same actions in another order), two stages per device where the family
# places two (interleaved, zb-v, dualpipe-v). 2BW follows its own, one-step-stale rule.
LORA_SCHEDULES = [s for s in schedules.available() if s != "zb-h1-tight"]
_REFERENCES: dict[str, Record] = {}  # one unsplit run per rule, for every schedule


@pytest.mark.parametrize("schedule", LORA_SCHEDULES)
def test_lora_llama_trains_exactly(schedule: str) -> None:
    """3 AdamW steps: the loss and every adapter's gradient equal the unsplit model's (2BW:
    the unsplit model's under 2BW's stale rule), and so do the weights after each step; the
    frozen weights get no gradient. The model is exported once for every schedule (the
    graph does not depend on the schedule)."""
    case = _lora_case()
    rule = "stale" if schedule == "2bw" else "plain"
    if rule not in _REFERENCES:
        _REFERENCES[rule] = _stale_steps(case) if rule == "stale" else reference_steps(case)
    want = _REFERENCES[rule]
    model = case.model()
    two = schedules.info(schedule).stages_per_rank == 2
    points = case.blocks[1:] if two else case.blocks[2:3]
    with exports_reused():
        pipe = Pipe(model, example_inputs=case.inputs, split_points=points,
                    devices=["cpu", "cpu"], chunks=4, schedule=schedule)
    try:
        got = pipe_steps(pipe, model, case)
        assert_same_training(got, want)
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trained and all("lora_" in n for n in trained)
        assert set(got.grads[-1]) == trained
        model.eval()
        out = pipe(case.inputs)
        with torch.no_grad():
            ref = model(**case.inputs)
        assert len(out.hidden_states) == len(ref.hidden_states) == 5
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    finally:
        pipe.close()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_position_ids_broadcast_over_the_batch_go_whole_to_every_micro_batch() -> None:
    """position_ids of shape (1, T), as the model broadcasts them over the batch."""
    case = llama_case()
    model = case.model()
    inputs = {**case.inputs, "position_ids": torch.arange(12).flip(0)[None]}
    pipe = Pipe(model, example_inputs=inputs, split_points=LLAMA_CUT,
                devices=["cpu", "cpu"], chunks=4)
    try:
        got = pipe_steps(pipe, model, Case("llama", case.build, inputs, case.labels,
                                           case.blocks, case.loss))
        want = reference_steps(Case("llama", case.build, inputs, case.labels, case.blocks,
                                    case.loss))
        assert_same_training(got, want)
        with pytest.raises(PipeConfigError, match="position_ids"):
            pipe.step({**inputs, "position_ids": torch.arange(12).expand(8, 12)},
                      case.labels, case.loss)
    finally:
        pipe.close()
