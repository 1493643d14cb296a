"""Batches as Hugging Face's collators give them, into a model split from its graph: a
`BatchEncoding` as inputs, masked-LM labels under token micro-batches, seq2seq labels of the
decoder's own length, a single packed row; each exact against the unsplit model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from pipeline import Pipe
from tests.models_collators import BLOCK, VOCAB, build, padded
from tests.pipeline.reference import grads_equal

transformers = pytest.importorskip("transformers")

# float64 models, but Hugging Face computes its loss in float32 (it upcasts the logits): the
# loss, and the gradient it sends back, carry float32 rounding (~1e-7 relative).
HF_TOL = {"rtol": 1e-5, "atol": 1e-8}


def _model_loss(out: object, target: object) -> torch.Tensor:
    return out.loss  # type: ignore[attr-defined,no-any-return]


def _exact(name: str, inputs: dict[str, object], chunks: int, **options: object) -> int:
    """One step of the split model (its own loss, token micro-batches) against the unsplit
    model's on the padded batch; returns how many gradients were compared."""
    model = build(name)
    reference = copy.deepcopy(model)
    pipe = Pipe(model, example_inputs=inputs, split_points=[BLOCK[name]], chunks=chunks,
                **options)
    loss = pipe.step(inputs, None, _model_loss, tokens=True)
    expected = reference(**inputs).loss
    expected.backward()
    return grads_equal(model, reference, loss, expected, name, HF_TOL)


@pytest.mark.parametrize("name", ["roberta_mlm", "distilbert_mlm"])
def test_masked_lm_labels_trimmed_by_tokens_are_contiguous(name: str) -> None:
    """DataCollatorForLanguageModeling's labels (-100 but at masked tokens) once reached the
    model as a non-contiguous slice under tokens=True, and RoBERTa's and DistilBERT's
    `labels.view(-1)` raised `view size is not compatible`."""
    pad = 0 if name == "distilbert_mlm" else 1
    ids, mask = padded([9, 3, 6, 2, 8, 4], 10, pad=pad)
    chosen = (torch.arange(10)[None] % 3 == 0) & (mask == 1)  # every row masks a token
    labels = ids.masked_fill(~chosen, -100)
    inputs = {"input_ids": ids.masked_fill(chosen, 2), "attention_mask": mask,
              "labels": labels}
    assert _exact(name, inputs, chunks=3) > 0


def test_a_batch_encoding_is_taken_as_the_dict_it_maps() -> None:
    """Every collator returns a BatchEncoding; Pipe(example_inputs=...), step and pipe(x)
    refused it: "a dict (got BatchEncoding)"."""
    ids, mask = padded([6, 3, 5, 2], 6)
    batch = transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask,
                                        "labels": ids.masked_fill(mask == 0, -100),
                                        "use_cache": False})
    model = build("qwen3")
    reference = copy.deepcopy(model)
    pipe = Pipe(model, example_inputs=batch, split_points=[BLOCK["qwen3"]], chunks=2)
    loss = pipe.step(batch, None, _model_loss)
    expected = reference(**batch).loss
    expected.backward()
    assert grads_equal(model, reference, loss, expected, "BatchEncoding", HF_TOL) > 0
    model.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(batch).logits, reference(**batch).logits, **HF_TOL)


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_seq2seq_labels_keep_the_decoders_length_under_tokens(name: str) -> None:
    """Decoder labels padded to the inputs' length (12 here) were cut at the encoder's
    lengths, and the step refused "row 4's padding" for a row with 12 decoder labels."""
    encoder = [12, 3, 7, 9, 2, 5]
    decoder = [4, 10, 6, 3, 12, 8]  # row 4: 2 input tokens, 12 labels
    pad = 0 if name == "t5" else 1
    ids, mask = padded(encoder, 12, pad=pad)
    targets, _ = padded(decoder, 12, seed=1)
    labels = targets.masked_fill(torch.arange(12)[None] >= torch.tensor(decoder)[:, None],
                                 -100)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}
    assert _exact(name, inputs, chunks=3) > 0


def test_a_single_packed_row_trains_on_the_models_own_loss() -> None:
    """DataCollatorWithFlattening's one row (1, 31) with chunks=1 and out.loss, no target,
    was refused ("holds the last stage ... pass target"); with the labels as target it
    trained exactly but warned that it trained wrong."""
    features = [{"input_ids": list(range(3, 3 + n))} for n in (10, 12, 9)]
    batch = transformers.DataCollatorWithFlattening()(features, return_tensors="pt")
    assert batch["input_ids"].shape == (1, 31)
    inputs = {**batch, "use_cache": False}
    model = build("qwen3")
    reference = copy.deepcopy(model)
    pipe = Pipe(model, example_inputs=inputs, split_points=[BLOCK["qwen3"]], chunks=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning that it trains wrong
        loss = pipe.step(inputs, None, _model_loss)
        again = pipe.step(inputs, batch["labels"], _model_loss)
    expected = reference(**inputs).loss
    (2 * expected).backward()  # two steps accumulated
    torch.testing.assert_close(again, loss)
    assert grads_equal(model, reference, 2 * loss, 2 * expected, "packed", HF_TOL) > 0
    assert int(batch["input_ids"].max()) < VOCAB
