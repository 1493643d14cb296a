"""Models and tensor-parallel plans for the tests of tp inside stages: an MLP (column then
row), a small transformer (Megatron's plan for attention and MLP) and its sequence-parallel
variant (torchtitan's: LayerNorms and the residual stream sharded along the sequence)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CONTEXT", "VOCAB", "WIDTH", "Attention", "Block", "Mlp", "batch", "mlp",
           "mlp_plan", "token_loss", "transformer", "transformer_plan"]

VOCAB, WIDTH, HEADS, CONTEXT = 32, 16, 4, 8


def mlp(seed: int = 0) -> nn.Sequential:
    """Two column-then-row pairs (6 layers)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 16),
                         nn.Tanh(), nn.Linear(16, 4))


def mlp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(),
            "5": RowwiseParallel()}


class Attention(nn.Module):
    """Causal self-attention; the head count comes from the width it is given (`-1`), so
    each tp rank runs its own heads."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        # No key bias: softmax ignores it, so its gradient is zero up to rounding, and AdamW
        # turns rounding noise into full-size steps (lr x noise / (|noise| + eps)).
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        heads = [f(x).view(b, t, -1, WIDTH // HEADS).transpose(1, 2)
                 for f in (self.q, self.k, self.v)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.drop(self.o(y.transpose(1, 2).reshape(b, t, -1)))


class Mlp(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.inner = nn.Dropout(dropout)  # on the hidden units, each tp rank's own shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.inner(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn, self.mlp = Attention(dropout), Mlp(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def transformer(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    """Embedding, four blocks, final LayerNorm, head (7 layers; the head untied)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *(Block(dropout) for _ in range(4)),
                         nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))


def transformer_plan(sequence_parallel: bool = False) -> dict[str, Any]:
    """Megatron's plan (q, k, v and fc by columns, o and proj by rows); with
    `sequence_parallel`, torchtitan's: the embedding by vocabulary rows into sequence
    shards, LayerNorms on sequence shards, attention and MLP gathering the sequence first,
    the head gathering it and its vocabulary columns."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {"*.attn.q": ColwiseParallel(), "*.attn.k": ColwiseParallel(),
                "*.attn.v": ColwiseParallel(), "*.attn.o": RowwiseParallel(),
                "*.mlp.fc": ColwiseParallel(), "*.mlp.proj": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "*.ln1": SequenceParallel(), "*.ln2": SequenceParallel(),
            "*.attn": gather, "*.attn.q": ColwiseParallel(), "*.attn.k": ColwiseParallel(),
            "*.attn.v": ColwiseParallel(), "*.attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "*.mlp": gather, "*.mlp.fc": ColwiseParallel(),
            "*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
            "5": SequenceParallel(),
            "6": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


def token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token (each row has CONTEXT of them: rows weigh alike)."""
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def batch(name: str, step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step `step` for model `name`: the same on every process."""
    g = torch.Generator().manual_seed(1000 + step)
    if name == "mlp":
        return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)
    ids = torch.randint(0, VOCAB, (rows, CONTEXT + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]
