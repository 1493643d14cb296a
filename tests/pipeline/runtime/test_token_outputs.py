"""`pipe(x, tokens=True)` puts each output back by what it is (pipeline/runtime/token_outputs.py):
outputs along the positions padded back, in every dim that is the positions; others (a
classifier's logits) as the model returns them, whatever the rows' lengths; a batch of fewer
rows than micro-batches refused as without tokens=."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.runtime.microbatch import MicroBatchError
from tests.models_collators import BLOCK, build, padded
from tests.pipeline.tokens_workers import masked_lm, padded_batch

pytest.importorskip("transformers")

# float64 models: trimmed micro-batches multiply other shapes than the padded batch, so sums
# run in another order; in float64 that rounding is ~1e-16 relative.
TOL = {"rtol": 1e-10, "atol": 1e-12}
# The lowest precision inside the model sets the tolerance, not the model's dtype. With
# tokens=True each micro-batch is trimmed to its longest row, so a reduction over the
# positions runs over another length than in the padded batch, and where that reduction is
# in float32 its rounding (unit roundoff 6e-8) depends on how the CPU's kernel splits the
# length into vector lanes: within a few float32 ulps, exactly equal on one CPU path only.
# - GPT-J computes its rotary table in float32 (a float32 buffer) and its attention in float32.
# - Qwen3's and Gemma2's eager attention take the softmax in float32
#   (`softmax(..., dtype=torch.float32)`): on an AVX2 kernel the weights (at most 1) differed
#   by 1.4e-8, where the AVX-512 one matched to 1e-16.
# A few float32 ulps of values of order 1: rtol 1e-6, atol 1e-7 (a weight put back in the
# wrong row or position is off by 1e-2 or more).
FLOAT32_INSIDE = {"rtol": 1e-6, "atol": 1e-7}
INNER_FLOAT32 = {"gptj", "qwen3", "gemma2"}


@pytest.mark.parametrize("lengths", [[3] * 8, [3, 6, 3, 6, 3, 6, 3, 6]])
def test_a_classifiers_logits_come_back_as_the_model_gives_them(lengths: list[int]) -> None:
    """3 labels on rows of 3 tokens padded to 8 once gave logits (8, 8), zeros in columns 3-7
    (dim 1 was taken for positions because it equalled the trimmed length); other lengths
    raised torch.cat's size error after all the compute."""
    model = build("roberta_cls", num_labels=3).eval()
    reference = copy.deepcopy(model)
    ids, mask = padded(lengths, 8)
    inputs = {"input_ids": ids, "attention_mask": mask}
    pipe = Pipe(model, example_inputs=inputs, split_points=[BLOCK["roberta_cls"]], chunks=2)
    with torch.no_grad():
        out, want = pipe(inputs, tokens=True), reference(**inputs)
    assert out.logits.shape == want.logits.shape == (8, 3)
    torch.testing.assert_close(out.logits, want.logits, **TOL)


@pytest.mark.parametrize("name", ["qwen3", "falcon", "gptj", "gemma2"])
def test_attention_weights_are_padded_back_in_both_position_dims(name: str) -> None:
    """output_attentions=True with tokens=True raised torch.cat's size error: the weights
    (rows, heads, length, length) were padded in dim 1 (the heads) or not at all."""
    model = build(name, attn_implementation="eager").eval()  # sdpa returns no weights
    reference = copy.deepcopy(model)
    ids, mask = padded([9, 3, 6, 2, 8, 4], 10)
    inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": False,
              "output_attentions": True}
    pipe = Pipe(model, example_inputs=inputs, split_points=[BLOCK[name]], chunks=3)
    with torch.no_grad():
        out, want = pipe(inputs, tokens=True), reference(**inputs)
    kept = mask.bool()
    tol = FLOAT32_INSIDE if name in INNER_FLOAT32 else TOL
    torch.testing.assert_close(out.logits[kept], want.logits[kept], **tol)
    assert len(out.attentions) == len(want.attentions) == 2
    for got, expected in zip(out.attentions, want.attentions, strict=True):
        assert got.shape == expected.shape == (6, 2, 10, 10)
        for row, n in enumerate(mask.sum(1).tolist()):  # queries and keys of its tokens
            torch.testing.assert_close(got[row, :, :n, :n], expected[row, :, :n, :n], **tol)


class _Pool(nn.Module):
    """(hidden, mask) -> class scores of each row: the mean over its tokens."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, classes)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, mask = x
        mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.proj(mean)


def test_an_nn_sequentials_outputs_by_their_sizes_over_two_lengths_at_least() -> None:
    """No graph says what an nn.Sequential's outputs are: every micro-batch trimmed to 3
    positions made class scores (rows, 3) look like positions; the cut now trims them to two
    lengths at least, and only a dim following both is padded."""
    model = masked_lm(width=8)
    model[-1] = _Pool(8, 3).double()
    ids, mask, _ = padded_batch([3] * 8, 8)
    reference = copy.deepcopy(model)
    pipe = Pipe(model, balance=[3, 2], chunks=2, tokens=True)
    with torch.no_grad():
        out, want = pipe((ids, mask)), reference((ids, mask))
    assert out.shape == want.shape == (8, 3)
    torch.testing.assert_close(out, want, **TOL)


def test_fewer_rows_than_micro_batches_are_refused_as_without_tokens() -> None:
    """tokens=True on 2 rows in 3 micro-batches raised `ValueError: max() arg is an empty
    sequence` from the grouping."""
    ids, mask, labels = padded_batch([4, 2], 6)
    pipe = Pipe(masked_lm(), balance=[3, 2], chunks=3, tokens=True)
    with pytest.raises(MicroBatchError, match="cannot split a batch of 2 rows into 3 "
                                              "micro-batches: use chunks <= 2"):
        pipe.step((ids, mask), labels, lambda out, y: out.sum())
    with pytest.raises(MicroBatchError, match="batch of 2 rows into 3"):
        pipe((ids, mask))
