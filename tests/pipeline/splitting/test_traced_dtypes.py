"""A dtype changed after the split: `pipe.to(torch.bfloat16)` or `.double()` on a model split
from its graph captures the model again in the new dtype (the graph bakes in the casts of the
one it saw: Llama's RMSNorm casts back to it), once per dtype, counted with the captures of new
shapes; the step then equals the unsplit model converted the same way."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pipeline
from pipeline import Pipe, PipeConfigError
from tests.models_traced import llama_case, token_count, token_loss

pytest.importorskip("transformers")

LLAMA_CUT = ["model.layers.2"]

# float64: the same ops in another summation order (the weights' gradients summed over 4
# micro-batches, not one batch): rounding of ~1e-16 relative per sum, so 1e-12 is far above
# it. Llama's RMSNorm and rotary tables compute in float32 even in a float64 model, but per
# token, the same in both (no sum across rows): measured, the largest difference is ~1e-15.
F64 = {"rtol": 1e-12, "atol": 1e-14}
# bfloat16: unit roundoff u = 2**-9. The forward runs the same ops per row; a weight's gradient
# is rounded to bfloat16 once per micro-batch (4 here) and added in bfloat16, where the unsplit
# model rounds one sum: each partial sum carries up to u of its own size, so the error of the
# total is a few u of the largest partial. rtol 8u = 2**-6 and an atol of 8u of the tensor's
# largest entry (entries near 0 by cancellation carry the partials' error, not their own).
# The loss: 4 micro-batch means each rounded to bfloat16, against one rounded mean (the
# reference's own rounding near 4.2 is up to 2u). Measured: gradients 3.9u of their tensor's
# largest entry at most, the loss 2.7u.
BF16_U = 2.0 ** -9


def _bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got, want, rtol=8 * BF16_U, atol=8 * BF16_U * scale,
                               msg=lambda m: f"{what}: {m}")


def _same_step(pipe: Pipe, model: nn.Module, reference: nn.Module, inputs: dict[str, Any],
               labels: torch.Tensor, dtype: torch.dtype) -> int:
    """One step of `pipe` and one of the unsplit `reference`: the loss and every gradient
    equal (F64 or bfloat16's tolerance); returns how many gradients were compared."""
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    loss = pipe.step(inputs, labels, token_loss, loss_weight=token_count)
    expected = token_loss(reference(**inputs), labels)
    expected.backward()
    assert expected.dtype == dtype
    close = (_bf16_close if dtype == torch.bfloat16 else
             lambda g, w, what: torch.testing.assert_close(g, w, **F64, msg=lambda m: f"{what}: "
                                                           f"{m}"))
    # The micro-batches' losses add in float32 at least (a bfloat16 batch's loss is float32).
    close(loss.to(dtype), expected.detach(), f"{dtype} loss")
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == dtype, name
        assert p.grad is not None and want[name].grad is not None, name
        assert p.grad.dtype == dtype, name
        close(p.grad, want[name].grad, f"{dtype} {name}")
    return len(want)


def test_a_dtype_changed_after_the_split_is_captured_again_once_per_dtype() -> None:
    """Llama captured in float32, then `pipe.to(torch.float64)`: captured again (2 captures),
    two steps equal the unsplit model converted alike (`model.to(torch.float64)`) and the
    second captures nothing; then `pipe.to(torch.bfloat16)`: a third capture, two steps as the
    unsplit model in bfloat16, and inference too; back to float32: the first capture again
    (still 3), exact against the unsplit model holding the same (bfloat16-rounded) values."""
    case = llama_case()
    model = case.model()
    pipe = Pipe(model, example_inputs=case.inputs, split_points=LLAMA_CUT,
                devices=["cpu", "cpu"], chunks=4)
    split = pipe._io
    try:
        assert split.captures == 1
        for dtype, captures in [(torch.float64, 2), (torch.bfloat16, 3)]:
            pipe.to(dtype)
            reference = case.model().to(dtype)  # f32 -> f64 -> bf16 rounds as f32 -> bf16
            for _ in range(2):
                assert _same_step(pipe, model, reference, case.inputs, case.labels, dtype)
                assert split.captures == captures, dtype
        model.eval()
        reference.eval()
        with torch.no_grad():
            _bf16_close(pipe(case.inputs).logits, reference(**case.inputs).logits,
                        "bfloat16 logits")
        assert split.captures == 3
        model.train()
        pipe.to(torch.float32)
        reference = copy.deepcopy(model)  # the float32 model, holding bfloat16's values
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = pipe.step(case.inputs, case.labels, token_loss, loss_weight=token_count)
        expected = token_loss(reference(**case.inputs), case.labels)
        expected.backward()
        # fp32, summation order only (tests/models_traced.py's tolerance)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        want = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-5, atol=1e-6)
        assert split.captures == 3
    finally:
        pipe.close()


class _Scaled(nn.Module):
    """A float constant made in its forward (a lifted tensor constant of the graph), and, in
    float16 only, a branch on a value (which export cannot capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * torch.tensor([0.1, 0.3, 0.7, 0.9, 1.1, 1.3, 1.7, 1.9]).to(x.dtype)
        if h.dtype == torch.float16 and h.sum() > 0:
            h = h * 2
        return self.b(torch.tanh(h))


def test_a_captures_constants_keep_their_dtype_through_a_round_trip() -> None:
    """`pipeline.split`'s stages (which hold each capture's constants) in float32, then
    bfloat16 (a second capture), then float32 again: the first capture's constant (0.1, ...)
    was not rounded to bfloat16 on the way (0.1 would come back as 0.10009765625, 1e-3 off),
    so the output equals the float32 model's."""
    torch.manual_seed(0)
    model = _Scaled()
    x = torch.randn(8, 4)
    stages = pipeline.split(model, (x,), split_points=["b"])
    stages.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        _bf16_close(stages(x.bfloat16()), reference(x.bfloat16()), "bfloat16 output")
    assert stages.captures == 2
    stages.to(torch.float32)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        # fp32, the same ops on the same batch
        torch.testing.assert_close(stages(x), reference(x), rtol=1e-6, atol=1e-7)
    assert stages.captures == 2


def test_a_dtype_the_model_cannot_be_captured_in_is_refused_before_any_work() -> None:
    """In float16 the model branches on a value: captured again in float16, export fails, and
    the step is refused naming the dtype and what to do (convert before splitting, or back);
    no gradient anywhere. Converted back, it trains."""
    torch.manual_seed(0)
    model = _Scaled()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = Pipe(model, example_inputs=(x,), split_points=["b"], devices=["cpu", "cpu"],
                chunks=2)
    try:
        pipe.to(torch.float16)
        with pytest.raises(PipeConfigError, match=r"is float16, where the graph was captured "
                           r"with it in float32.*captured again in float16, the model fails"
                           r".*model\.to\(torch\.float16\).*pipe\.to\(torch\.float32\)"):
            pipe.step(x.half(), y.half(), nn.MSELoss())
        assert all(p.grad is None for p in model.parameters())
        assert pipe._io.captures == 1
        pipe.to(torch.float32)
        loss = pipe.step(x, y, nn.MSELoss())
        assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
    finally:
        pipe.close()
