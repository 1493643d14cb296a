"""Small models as people write them, for the tests: a tied-head language model and a BN CNN."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ClassesFirst", "FlattenTokens", "Head", "TokenEmbedding", "lm_loss", "small_cnn",
           "tiny_lm"]


class TokenEmbedding(nn.Module):
    """Token plus learned position embeddings (GPT-2's `wte` + `wpe`), then dropout."""

    def __init__(self, vocab: int, width: int, context: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.drop(self.wte(ids) + self.wpe(positions))
        return out


class Head(nn.Module):
    """The output projection to the vocabulary; its weight is the embedding's (tied)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight  # the same Parameter object: GPT-2's lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class _Mlp(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.drop(self.down(torch.nn.functional.gelu(
            self.up(self.norm(x)))))
        return out


def tiny_lm(vocab: int = 13, width: int = 16, depth: int = 4, context: int = 8,
            dropout: float = 0.1, seed: int = 0) -> nn.Sequential:
    """Embedding, `depth` pre-norm residual MLP blocks, LayerNorm, a head tied to `wte`."""
    torch.manual_seed(seed)
    embedding = TokenEmbedding(vocab, width, context, dropout)
    return nn.Sequential(embedding, *[_Mlp(width, dropout) for _ in range(depth)],
                         nn.LayerNorm(width), Head(embedding.wte))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ClassesFirst(nn.Module):
    """(batch, tokens, vocab) -> (batch, vocab, tokens): the layout nn.CrossEntropyLoss takes
    for a sequence, so the loss module sees the labels as they are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class FlattenTokens(nn.Module):
    """(batch, tokens, vocab) -> (batch * tokens, vocab), as many language-model heads end."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1)


def small_cnn(channels: int = 4, classes: int = 5, seed: int = 0) -> nn.Sequential:
    """A ResNet-style stem and blocks with BatchNorm, flat in one nn.Sequential."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1), nn.BatchNorm2d(2 * channels),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, classes))
