"""Position tables read by a model split from its graph (OPT's learned positions counted from
the mask, RoBERTa's from the ids, GPT-J's rotary table indexed by position): a batch that
would read past one is refused before any work, naming the input, its length and the table,
and one that reads within runs as the unsplit model; under token micro-batches a target of
another length than the inputs is refused before any work."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import Pipe, PipeConfigError
from tests.models_collators import BLOCK, build, padded
from tests.models_traced import token_count

pytest.importorskip("transformers")

# float64 models, but Hugging Face computes its loss in float32 (it upcasts the logits).
HF_TOL = {"rtol": 1e-5, "atol": 1e-8}

# Per model: the input its positions are computed from, the table's rows, its name, and
# whether the positions count tokens (padding reads no new position) or run to the length.
TABLES = {
    "opt": ("attention_mask", 34, r"model\.decoder\.embed_positions\.weight", True),
    "roberta_mlm": ("input_ids", 34, r"roberta\.embeddings\.position_embeddings\.weight",
                    True),
    "gptj": ("attention_mask", 32, r"transformer\.rotary_emb\.embed_positions", False),
}


def _inputs(name: str, lengths: list[int], length: int) -> dict[str, Any]:
    ids, mask = padded(lengths, length)
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask,
                              "labels": ids.masked_fill(mask == 0, -100)}
    if name != "roberta_mlm":
        inputs["use_cache"] = False
    return inputs


def _model_loss(out: Any, target: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


Split = tuple[nn.Module, nn.Module, Pipe]


@pytest.fixture(scope="module")
def split() -> Iterator[Callable[[str], Split]]:
    """Each model split once (at 12 tokens, 2 stages, 2 micro-batches), with an unsplit
    copy, on first use."""
    made: dict[str, Split] = {}

    def get(name: str) -> Split:
        if name not in made:
            model = build(name)
            reference = copy.deepcopy(model)
            pipe = Pipe(model, example_inputs=_inputs(name, [12, 9, 5, 12], 12),
                        split_points=[BLOCK[name]], chunks=2)
            made[name] = (model, reference, pipe)
        return made[name]
    yield get
    for _, _, pipe in made.values():
        pipe.close()


def _untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("name", list(TABLES))
def test_a_batch_past_the_position_table_is_refused_before_any_work(
        name: str, split: Callable[[str], Split]) -> None:
    """33 tokens in a row read position 32 of GPT-J's 32-row rotary table, position 34 of
    OPT's and RoBERTa's 34 rows (their positions start at 2): the unsplit model fails in
    its forward (IndexError), the split one failed at 0F0. Refused, naming the input the
    positions come from, its length, the table and the fix; 32 tokens run as the unsplit
    model."""
    model, reference, pipe = split(name)
    source, rows, table, _ = TABLES[name]
    before = copy.deepcopy(model.state_dict())
    inputs = _inputs(name, [33, 20, 33, 7], 33)
    with pytest.raises(PipeConfigError,
                       match=rf"input '{source}' has size 33 in dim 1.*positions below "
                             rf"{rows} .*{table}.*truncate.*Nothing was computed"):
        pipe.step(inputs, None, _model_loss)
    _untouched(model, before)
    inputs = _inputs(name, [32, 20, 32, 7], 32)
    model.zero_grad(set_to_none=True)
    loss = pipe.step(inputs, None, _model_loss)
    torch.testing.assert_close(loss, reference(**inputs).loss.detach(), **HF_TOL)


@pytest.mark.parametrize("name", list(TABLES))
def test_padding_past_the_table_runs_where_positions_count_tokens(
        name: str, split: Callable[[str], Split]) -> None:
    """Rows of at most 32 tokens padded to 40: OPT and RoBERTa give padding no new position
    (the unsplit models run), so the split models run too, as the unsplit ones; GPT-J's
    positions run to the length (its unsplit forward fails): refused before any work."""
    model, reference, pipe = split(name)
    source, rows, table, counts_tokens = TABLES[name]
    inputs = _inputs(name, [32, 20, 31, 7], 40)
    model.zero_grad(set_to_none=True)
    if not counts_tokens:
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(PipeConfigError, match=rf"input '{source}' has size 40 in dim 1"
                                                  rf".*positions below {rows} .*{table}"):
            pipe.step(inputs, None, _model_loss)
        _untouched(model, before)
        return
    loss = pipe.step(inputs, None, _model_loss)
    torch.testing.assert_close(loss, reference(**inputs).loss.detach(), **HF_TOL)


def test_ranks_refuse_together_a_batch_read_past_the_table(split: Callable[[str], Split]) -> None:
    """Across processes only the ranks holding the batch can count OPT's positions from its
    mask: the count travels with the shapes they exchange, so a rank without the batch
    refuses as they do (else it would wait for activations that never come)."""
    _, _, pipe = split("opt")
    lengths = pipe._io.lengths
    inputs = _inputs("opt", [33, 20, 33, 7], 33)
    said: dict[int, str] = {}

    def rank(r: int, answer: bool) -> Callable[[str], list[str]]:
        def exchange(payload: str) -> list[str]:
            said[r] = payload
            return [said[0], said[1]] if answer else [payload]
        return exchange
    try:
        lengths.exchange = rank(1, answer=False)  # what rank 1 says, passing None
        pipe._io.prepare(None)
        for r, batch in ((0, inputs), (1, None)):
            lengths.exchange = rank(r, answer=True)
            with pytest.raises(PipeConfigError, match=r"input 'attention_mask' has size 33"):
                pipe._io.prepare(batch)
    finally:
        lengths.exchange = None


def _shifted_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss on labels shifted outside it (one shorter than the inputs)."""
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)


def test_a_target_shorter_than_the_inputs_is_refused_under_tokens(
        split: Callable[[str], Split]) -> None:
    """tokens=True trims the logits to each micro-batch's longest row, and the target with
    them where it is as long as the inputs: labels shifted outside the loss (one shorter)
    were left whole, and the last stage failed with torch's batch-size message. Refused
    before any work, naming both shapes and what to do; without tokens= they run."""
    model, reference, pipe = split("opt")
    inputs = _inputs("opt", [12, 5, 9, 3, 12, 7], 12)
    target = inputs["labels"][:, 1:]
    model.zero_grad(set_to_none=True)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(PipeConfigError,
                       match=r"target has shape \(6, 11\).*inputs' \(6, 12\).*as long as "
                             r"the inputs.*shift"):
        pipe.step(inputs, target, _shifted_loss, tokens=True, loss_weight=token_count)
    _untouched(model, before)
    loss = pipe.step(inputs, target, _shifted_loss, loss_weight=token_count)
    torch.testing.assert_close(loss, _shifted_loss(reference(**inputs), target).detach(),
                               **HF_TOL)
