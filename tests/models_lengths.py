"""Hugging Face models (small random configs) with batches of any length: GPT-2 (tied head),
Llama and BERT whose position tables take 32 positions, each batch at the length asked, with
right padding and labels -100 past each row's tokens; and packed rows (several documents per
row, position_ids restarting at each)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.models_traced import Case, pad_labels, token_loss

__all__ = ["CAPTURED", "POSITIONS", "batch", "length_case", "packed"]

VOCAB, POSITIONS, CAPTURED = 64, 32, 12  # vocabulary, position table rows, captured length


def _build(name: str) -> Any:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    def build(dropout: float) -> nn.Module:
        torch.manual_seed(0)
        if name == "gpt2":
            return GPT2LMHeadModel(GPT2Config(
                vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=4, n_head=2,
                resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))
        if name == "llama":
            return LlamaForCausalLM(LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=POSITIONS, attention_dropout=dropout,
                tie_word_embeddings=False))
        return BertForMaskedLM(BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=POSITIONS, type_vocab_size=2,
            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))
    return build


BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer"}


def batch(name: str, length: int, rows: int = 8, seed: int = 0
          ) -> tuple[dict[str, Any], torch.Tensor]:
    """A batch of `rows` rows of `length` tokens as a collator pads it (right padding, an
    attention mask for Llama and BERT) and its labels (-100 past each row's tokens; BERT's
    only at masked positions)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    lengths = [max(1, length - (r * 5) % (length // 2 + 1)) for r in range(rows)]
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    labels = pad_labels(ids, lengths)
    if name == "gpt2":
        return {"input_ids": ids, "use_cache": False}, labels
    if name == "llama":
        return {"input_ids": ids, "attention_mask": mask, "use_cache": False}, labels
    masked = torch.rand(ids.shape, generator=gen) < 0.3
    masked[:, 0] = True  # every row counts a token
    labels = torch.where(masked & (mask == 1), ids, torch.full_like(ids, -100))
    segments = torch.zeros_like(ids)
    segments[:, length // 2:] = 1
    return {"input_ids": ids, "token_type_ids": segments, "attention_mask": mask}, labels


def length_case(name: str, length: int = CAPTURED, rows: int = 8, seed: int = 0) -> Case:
    """The model `name` ("gpt2", "llama", "bert") with a batch of `length` tokens."""
    inputs, labels = batch(name, length, rows, seed)
    return Case(name, _build(name), inputs, labels,
                [f"{BLOCKS[name]}.{i}" for i in range(4)], token_loss)


def packed(documents: list[list[int]], seed: int = 0) -> tuple[dict[str, Any], torch.Tensor]:
    """Llama's inputs for rows packing documents of the given lengths (every row as long):
    position_ids restart at 0 at each document, as DataCollatorWithFlattening gives them, no
    attention mask; labels -100 at each document's first token (nothing predicts it)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    ids = torch.randint(0, VOCAB, positions.shape, generator=gen)
    labels = torch.where(positions == 0, torch.full_like(ids, -100), ids)
    return {"input_ids": ids, "position_ids": positions, "use_cache": False}, labels
