"""Hugging Face models from small random configs (hidden 16, 1-2 layers, vocabulary 64) and
batches shaped as the collators give them (right padding, labels -100 where nothing counts),
built by hand: no tokenizer, no download."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["BLOCK", "VOCAB", "build", "padded"]

VOCAB, POSITIONS = 64, 32
# Where each model's second block begins: the split point of a 2-stage split.
BLOCK = {"qwen3": "model.layers.1", "falcon": "transformer.h.1", "gptj": "transformer.h.1",
         "gemma2": "model.layers.1", "opt": "model.decoder.layers.1",
         "roberta_cls": "roberta.encoder.layer.1", "roberta_mlm": "roberta.encoder.layer.1",
         "distilbert_mlm": "distilbert.transformer.layer.1", "bart": "model.decoder",
         "t5": "decoder"}


def build(name: str, dtype: torch.dtype = torch.float64, **options: Any) -> nn.Module:
    """The model `name` (a key of BLOCK), seeded, dropout 0, in `dtype` (float64: trimmed
    micro-batches multiply other shapes than the padded batch, and float64 keeps that
    rounding near 1e-16)."""
    import transformers as hf

    torch.manual_seed(0)
    small = {"vocab_size": VOCAB}
    decoder = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
               "max_position_embeddings": POSITIONS, **small}
    encoder = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "max_position_embeddings": POSITIONS + 2,
               "pad_token_id": 1, "hidden_dropout_prob": 0.0,
               "attention_probs_dropout_prob": 0.0, **small}
    seq2seq = {"pad_token_id": 1, "decoder_start_token_id": 2, "eos_token_id": 2,
               "bos_token_id": 0, "dropout": 0.0, **small}
    model: nn.Module
    if name == "qwen3":
        model = hf.Qwen3ForCausalLM(hf.Qwen3Config(**decoder, **options))
    elif name == "gemma2":
        model = hf.Gemma2ForCausalLM(hf.Gemma2Config(**decoder, **options))
    elif name == "falcon":
        model = hf.FalconForCausalLM(hf.FalconConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, **small, **options))
    elif name == "gptj":
        model = hf.GPTJForCausalLM(hf.GPTJConfig(
            n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=POSITIONS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **small, **options))
    elif name == "opt":
        model = hf.OPTForCausalLM(hf.OPTConfig(
            hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=POSITIONS, word_embed_proj_dim=16, pad_token_id=1,
            dropout=0.0, **small, **options))
    elif name == "roberta_cls":
        model = hf.RobertaForSequenceClassification(hf.RobertaConfig(**encoder, **options))
    elif name == "roberta_mlm":
        model = hf.RobertaForMaskedLM(hf.RobertaConfig(**encoder, **options))
    elif name == "distilbert_mlm":
        model = hf.DistilBertForMaskedLM(hf.DistilBertConfig(
            dim=16, hidden_dim=32, n_layers=2, n_heads=2, max_position_embeddings=POSITIONS,
            pad_token_id=0, dropout=0.0, attention_dropout=0.0, **small, **options))
    elif name == "bart":
        model = hf.BartForConditionalGeneration(hf.BartConfig(
            d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
            max_position_embeddings=POSITIONS, **seq2seq, **options))
    elif name == "t5":
        model = hf.T5ForConditionalGeneration(hf.T5Config(
            d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
            dropout_rate=0.0, **{**seq2seq, "pad_token_id": 0, "decoder_start_token_id": 0},
            **options))
    else:
        raise KeyError(name)
    return model.to(dtype)


def padded(lengths: list[int], length: int, seed: int = 0, pad: int = 1
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (`pad` past each row's tokens, as DataCollatorWithPadding fills them) and the
    attention mask of rows of `lengths` padded on the right to `length`."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, VOCAB, (len(lengths), length), generator=gen)
    return ids.masked_fill(mask == 0, pad), mask
