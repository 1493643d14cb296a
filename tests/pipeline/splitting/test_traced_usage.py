"""Using a model split from its graph: train and eval graphs, dropout replayed under
recomputation, the ways inputs are given (and refused), gradients of inputs, and the errors a
model that cannot be split, or a split point that cannot be, gets."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch
from torch import nn

import pipeline
from pipeline import Pipe, PipeConfigError
from pipeline.splitting.cut import SplitPointError
from pipeline.splitting.trace import ExportError
from tests.models_traced import (
    gpt2_case,
    llama_case,
    pad_labels,
    reference_steps,
    token_count,
    token_loss,
    unet_case,
)

GPT2_CUT = ["transformer.h.2"]
UNET_CUTS = ["enc2", "dec2"]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_eval_runs_the_models_eval_graph_and_train_switches_back() -> None:
    """With dropout in the config, `pipe.eval(); pipe(x)` is `model.eval()(x)` (dropout off),
    and after `pipe.train()` the train graph runs again (dropout on: other outputs)."""
    case = gpt2_case()
    model = case.model(dropout=0.3)
    pipe = Pipe(model, example_inputs=case.inputs, split_points=GPT2_CUT,
                devices=["cpu", "cpu"], chunks=2)
    try:
        pipe.eval()
        got = pipe(case.inputs)
        model.eval()
        with torch.no_grad():
            want = model(**case.inputs)
        assert type(got) is type(want)  # the ModelOutput, as the model returns it
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
        model.train()
        pipe.train()
        trained = pipe(case.inputs)
        assert not torch.allclose(trained.logits, want.logits, rtol=1e-2, atol=1e-2)
        pipe.eval()  # and back: the eval graph again
        torch.testing.assert_close(pipe(case.inputs).logits, want.logits, rtol=1e-5, atol=1e-6)
    finally:
        pipe.close()


def test_recomputation_replays_the_forwards_dropout_masks() -> None:
    """With dropout on, every recomputation mode leaves the gradients of "never" under the same
    seed: each replay draws its forward's masks. Another seed gives other gradients, so the
    masks matter."""
    case = gpt2_case()
    model = case.model(dropout=0.2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    split = pipeline.split(model, case.inputs, split_points=GPT2_CUT)
    runs = {}
    for name, checkpoint, seed in (("never", "never", 7), ("except_last", "except_last", 7),
                                   ("always", "always", 7), ("other seed", "never", 8)):
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        pipe = Pipe(split, balance=[1, 1], devices=["cpu", "cpu"], chunks=4,
                    checkpoint=checkpoint)
        torch.manual_seed(seed)
        pipe.step(case.inputs, case.labels, case.loss, loss_weight=token_count)
        pipe.close()
        runs[name] = _grads(model)
    for name in ("except_last", "always"):
        for key, grad in runs["never"].items():
            torch.testing.assert_close(runs[name][key], grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key, n=name: f"{n}: {k}: {m}")
    wpe = "transformer.wpe.weight"
    assert not torch.allclose(runs["other seed"][wpe], runs["never"][wpe], rtol=1e-3)


@pytest.mark.parametrize("form", ["tensor", "tuple", "args and kwargs", "dict"])
def test_inputs_in_every_form(form: str) -> None:
    """A tensor, a tuple of positional arguments, a pair (args, kwargs) or a dict of keyword
    arguments: given so to example_inputs and to step and forward, the same training."""
    case = unet_case()
    images = case.inputs["images"]
    given: Any = {"tensor": images, "tuple": (images,), "args and kwargs": ((images,), {}),
                  "dict": {"images": images}}[form]
    model = case.model()
    pipe = Pipe(model, example_inputs=given, split_points=UNET_CUTS, devices=["cpu"] * 3,
                chunks=1, schedule="gpipe")
    try:
        loss = pipe.step(given, case.labels, case.loss, loss_weight=token_count)
        want = reference_steps(case)  # chunks=1: BatchNorm over the whole batch, as here
        torch.testing.assert_close(loss, want.losses[0], rtol=1e-5, atol=1e-6)
        for key, grad in want.grads[0].items():
            torch.testing.assert_close(model.get_parameter(key).grad, grad, rtol=1e-5,
                                       atol=1e-6, msg=key)
        pipe.eval()
        out = pipe(given)
        assert set(out) == {"logits", "features"}
        assert out["logits"].shape == (8, 3, 8, 8) and out["features"].shape == (8, 8, 2, 2)
    finally:
        pipe.close()


def test_positional_and_fixed_keyword_arguments() -> None:
    """GPT-2 called as `model(ids, use_cache=False)`: (args, kwargs) with a fixed non-tensor
    keyword trains as the model; the wrong keywords or a changed `use_cache` are refused,
    naming the difference, in step and in forward."""
    case = gpt2_case()
    model = case.model()
    ids = case.inputs["input_ids"]
    given = ((ids,), {"use_cache": False})
    pipe = Pipe(model, example_inputs=given, split_points=GPT2_CUT, devices=["cpu", "cpu"],
                chunks=4)
    try:
        loss = pipe.step(given, case.labels, case.loss, loss_weight=token_count)
        want = reference_steps(case)
        torch.testing.assert_close(loss, want.losses[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.transformer.wte.weight.grad,
                                   want.grads[0]["transformer.wte.weight"], rtol=1e-5,
                                   atol=1e-6)
        with pytest.raises(PipeConfigError, match=re.escape(
                "split for keyword inputs ['use_cache']; got ['input_ids', 'use_cache']")):
            pipe.step({"input_ids": ids, "use_cache": False}, case.labels, case.loss)
        with pytest.raises(PipeConfigError, match="is True, but the model was split with False"):
            pipe.step(((ids,), {"use_cache": True}), case.labels, case.loss)
        with pytest.raises(PipeConfigError, match="is True, but the model was split with False"):
            pipe(((ids,), {"use_cache": True}))
        with pytest.raises(PipeConfigError, match=re.escape("got []")):
            pipe(ids)  # no use_cache at all
    finally:
        pipe.close()


def test_input_gradients_reach_the_callers_tensor() -> None:
    """A float input that requires grad (GPT-2's `inputs_embeds`) gets the gradient the model
    gives it, on the caller's own tensor."""
    case = gpt2_case()
    model = case.model()
    embeds = torch.randn(8, 12, 32, generator=torch.Generator().manual_seed(9))
    ours = embeds.clone().requires_grad_()
    theirs = embeds.clone().requires_grad_()
    given = {"inputs_embeds": ours, "use_cache": False}
    pipe = Pipe(model, example_inputs=given, split_points=GPT2_CUT, devices=["cpu", "cpu"],
                chunks=4, checkpoint="always")
    try:
        pipe.step(given, case.labels, case.loss, loss_weight=token_count)
    finally:
        pipe.close()
    reference = case.model()
    token_loss(reference(inputs_embeds=theirs, use_cache=False), case.labels).backward()
    assert ours.grad is not None
    # Rows whose labels are all -100 (rows 3 to 5) get no gradient: a zero, not a missing one.
    assert torch.count_nonzero(ours.grad[3:6]) == 0 and torch.count_nonzero(ours.grad[0]) > 0
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)


class _Gate(nn.Module):
    """Doubles its input when the input's sum is positive: Python branching on a value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = _Gate()
        self.out = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.inp(x)))


class _Plain(_Gated):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x))


class _FixedBatch(_Gated):
    """Reshapes by a literal count of rows: every micro-batch must have 8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x).view(8, 4))


def test_data_dependent_control_flow_names_the_module_and_the_line() -> None:
    lines, first = inspect.getsourcelines(_Gate.forward)
    line = first + next(i for i, text in enumerate(lines) if "if x.sum() > 0" in text)
    with pytest.raises(ExportError) as info:
        pipeline.split(_Gated(), torch.randn(8, 4), split_points=["out"])
    message = str(info.value)
    assert "in module 'gate'" in message
    assert f"test_traced_usage.py:{line} (if x.sum() > 0:)" in message
    assert "torch.cond" in message  # and the way out


def test_misspelt_split_point_names_the_nearest_modules() -> None:
    case = llama_case()
    with pytest.raises(SplitPointError, match=re.escape(
            "split point 'model.layer.2' is not a module of LlamaForCausalLM; nearest: "
            "'model.layers.2'")):
        pipeline.split(case.model(), case.inputs, split_points=["model.layer.2"])


def test_split_points_out_of_order() -> None:
    case = unet_case()
    with pytest.raises(SplitPointError, match="'enc2' runs before 'dec2'; list them in order"):
        pipeline.split(case.model(), case.inputs, split_points=["dec2", "enc2"])


def test_split_point_that_never_runs() -> None:
    with pytest.raises(SplitPointError, match="split point 'spare' never runs"):
        pipeline.split(_Plain(), torch.randn(8, 4), split_points=["spare"])


def test_fixed_batch_size_is_refused_at_the_split() -> None:
    """A model whose code fixes the batch size could not run a micro-batch of another size."""
    with pytest.raises(ExportError, match="the model fixes the batch size of input 'x' to 8"):
        pipeline.split(_FixedBatch(), torch.randn(8, 4), split_points=["out"])


def test_layer_counts_are_refused_with_example_inputs() -> None:
    with pytest.raises(PipeConfigError, match=re.escape(
            "balance=[1, 1] counts layers of an nn.Sequential; a model split from its graph "
            "takes split_points=[module names]")):
        Pipe(_Plain(), [1, 1], example_inputs=torch.randn(8, 4))


def test_split_points_need_example_inputs() -> None:
    with pytest.raises(PipeConfigError, match="pass example_inputs= too"):
        Pipe(_Plain(), split_points=["out"])


def test_a_model_without_example_inputs_is_told_how_to_split_it() -> None:
    with pytest.raises(PipeConfigError, match="or any model with example_inputs="):
        Pipe(_Plain(), devices=["cpu", "cpu"])


def test_padded_labels_helper() -> None:
    """The helper the suite's labels come from: -100 past each row's length."""
    ids = torch.arange(6).reshape(2, 3)
    assert pad_labels(ids, [2, 0]).tolist() == [[0, 1, -100], [-100, -100, -100]]
    assert token_count(pad_labels(ids, [2, 0])) == 2


def test_layerdrop_names_the_config_fields_to_set_to_zero() -> None:
    """M2M100's default LayerDrop (a random draw in Python that export cannot capture) was
    refused with the generic advice to rewrite the construct; the refusal names the config
    fields that are not 0 and says to set them to 0."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.M2M100Config(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=64)
    model = transformers.M2M100ForConditionalGeneration(config)
    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    with pytest.raises(ExportError, match=r"encoder_layerdrop=0\.05, decoder_layerdrop=0\.05.*"
                                          r"set them to 0 in the config"):
        Pipe(model, example_inputs=inputs, split_points=["model.decoder"],
             devices=["cpu", "cpu"], chunks=2)
