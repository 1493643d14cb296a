"""A GPT-2-style language model as one flat nn.Sequential, its output head tied to the embedding."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "CausalSelfAttention", "Embedding", "Head", "gpt", "lm_loss"]


class Embedding(nn.Module):
    """Token ids (batch, T), int64 -> token + learned position embeddings (batch, T, width)."""

    def __init__(self, vocab: int, *, context: int, width: int, dropout: float) -> None:
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.context:
            raise ValueError(f"a sequence of {length} tokens is longer than the model's "
                             f"context of {self.context}: crop it to the last {self.context}")
        positions = torch.arange(length, device=ids.device)
        out: torch.Tensor = self.drop(self.wte(ids) + self.wpe(positions))
        return out


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, width: int, *, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}: each head "
                             f"takes width // heads channels; pick heads dividing width")
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)  # a residual projection (scaled at init)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (batch, T, 3 * width) -> three (batch, heads, T, width // heads)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, length, width)
        out: torch.Tensor = self.drop(self.proj(y))
        return out


class _MLP(nn.Module):
    """Linear(width, 4 width), GELU, Linear(4 width, width), dropout."""

    def __init__(self, width: int, *, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * width, width)  # a residual projection (scaled at init)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.proj(self.act(self.fc(x))))
        return out


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attention(ln(x)), then x + MLP(ln(x))."""

    def __init__(self, width: int, *, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads=heads, dropout=dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = _MLP(width, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class Head(nn.Module):
    """Hidden states (batch, T, width) -> logits (batch, T, vocab): a linear map without bias.

    Given `weight` (the embedding's `wte.weight`), the head uses that very Parameter, as
    GPT-2's lm_head does: one (vocab, width) matrix both reads tokens in and scores them out.
    """

    def __init__(self, vocab: int, width: int, *, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight is None:
            weight = nn.Parameter(torch.empty(vocab, width))
        elif not isinstance(weight, nn.Parameter):
            raise TypeError(f"a tied head weight must be the embedding's Parameter itself (got "
                            f"a {type(weight).__name__}): pass embedding.wte.weight")
        elif tuple(weight.shape) != (vocab, width):
            raise ValueError(f"a tied head weight must be (vocab, width) = ({vocab}, {width}), "
                             f"got {tuple(weight.shape)}: pass the embedding's wte.weight")
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def gpt(vocab: int, *, context: int, width: int, depth: int, heads: int,
        dropout: float = 0.1, tied: bool = True) -> nn.Sequential:
    """Embedding, `depth` Blocks, LayerNorm, Head, flat in one nn.Sequential (depth + 3 layers).

    GPT-2's initialisation: every Linear and Embedding weight ~ N(0, 0.02), biases 0, and the
    projections that write into the residual stream (attention's and the MLP's `proj`)
    ~ N(0, 0.02 / sqrt(2 * depth)), so the stream's variance does not grow with depth.
    With `tied` (the default) the head's weight is the embedding's `wte.weight` object.
    """
    embedding = Embedding(vocab, context=context, width=width, dropout=dropout)
    blocks = [Block(width, heads=heads, dropout=dropout) for _ in range(depth)]
    head = Head(vocab, width, weight=embedding.wte.weight if tied else None)
    model = nn.Sequential(embedding, *blocks, nn.LayerNorm(width), head)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding | Head):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for block in blocks:
        for projection in (block.attn.proj, block.mlp.proj):
            nn.init.normal_(projection.weight, mean=0.0, std=0.02 / math.sqrt(2 * depth))
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (batch, T, vocab) against int64 targets (batch, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
