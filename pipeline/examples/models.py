"""Benchmark models: the reference MLP, a transformer-like stack, an unbalanced MLP, small ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.splitting.partition import split_sizes
from pipeline.splitting.profile import balance_by_params, balance_by_time

__all__ = ["MODELS", "ModelSpec", "TokenCrossEntropy", "balance_for", "get_model"]


@dataclass(frozen=True)
class ModelSpec:
    """A model, its batch and its loss, all deterministic (every rank builds the same ones)."""

    name: str
    description: str
    build: Callable[[], nn.Sequential]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[], nn.Module]
    batch_size: int
    balance_methods: tuple[str, ...] = ("params",)


def _block(width_in: int, width_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width_in, width_out), nn.GELU())


def _stack(width: int, blocks: int, out: int) -> nn.Sequential:
    """`blocks` x [Linear(width, width) + GELU] + Linear(width, out), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(*[_block(width, width) for _ in range(blocks)], nn.Linear(width, out))


def _rows(rows: int, width: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g), torch.randn(rows, out, generator=g)


# The reference point against torch: keep it exactly. 9 layers, each a Linear(+GELU).
_mlp, _mlp_batch = partial(_stack, 1024, 8, 16), partial(_rows, 64, 1024, 16)
# The same shape at width 32: compute is negligible, so a step is a chain of messages (the
# latency-bound regime of short actions on fast accelerators).
_small, _small_batch = partial(_stack, 32, 8, 16), partial(_rows, 64, 32, 16)
_tiny, _tiny_batch = partial(_stack, 32, 4, 4), partial(_rows, 16, 32, 4)


class _Wide(nn.Module):
    """Linear(w, 4w) + GELU + Linear(4w, w): sixteen times a narrow block's work."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


def _unbalanced() -> nn.Sequential:
    # Six cheap layers, then three 8x more expensive ones: a uniform split by layer count puts
    # almost all the work on the last stage; the time-profiled split does not.
    torch.manual_seed(0)
    return nn.Sequential(*[_block(512, 512) for _ in range(6)], *[_Wide(512) for _ in range(3)],
                         nn.Linear(512, 16))


def _unbalanced_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 512, generator=g), torch.randn(64, 16, generator=g)


_VOCAB, _WIDTH, _HEADS, _SEQ, _LAYERS, _TOKENS_BATCH = 512, 128, 4, 32, 4, 16


class _Embedding(nn.Module):
    """Token ids (batch, seq) -> token + position embeddings (batch, seq, width)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(_VOCAB, _WIDTH)
        self.positions = nn.Parameter(torch.randn(_SEQ, _WIDTH) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tokens(ids) + self.positions[: ids.shape[1]]
        return out


class _Residual(nn.Module):
    """x + MLP(LayerNorm(x)): a pre-norm transformer MLP block."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(self.act(self.up(self.norm(x))))
        return out


class _Attention(nn.Module):
    """Pre-norm causal self-attention with a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_WIDTH)
        self.qkv = nn.Linear(_WIDTH, 3 * _WIDTH)
        self.proj = nn.Linear(_WIDTH, _WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, _HEADS, w // _HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        out: torch.Tensor = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return out


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_WIDTH)
        self.out = nn.Linear(_WIDTH, _VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.norm(x))
        return out


class TokenCrossEntropy(nn.Module):
    """Cross-entropy over every token: logits (batch, seq, vocab), targets (batch, seq)."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _transformer() -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(_LAYERS):
        blocks += [_Attention(), _Residual(_WIDTH, 4 * _WIDTH)]  # the pre-norm MLP block
    return nn.Sequential(_Embedding(), *blocks, _Head())


def _transformer_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, _VOCAB, (_TOKENS_BATCH, _SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec("mlp", "8 x [Linear(1024,1024)+GELU] + Linear(1024,16), batch 64, MSE",
                  _mlp, _mlp_batch, nn.MSELoss, 64),
        ModelSpec("transformer", f"embedding + {_LAYERS} x [attention, MLP] + head, width "
                  f"{_WIDTH}, {_HEADS} heads, seq {_SEQ}, vocab {_VOCAB}, batch "
                  f"{_TOKENS_BATCH}, cross-entropy", _transformer, _transformer_batch,
                  TokenCrossEntropy, _TOKENS_BATCH),
        ModelSpec("unbalanced", "6 x [Linear(512,512)+GELU] + 3 x [Linear(512,2048)+GELU+"
                  "Linear(2048,512)] + Linear(512,16), batch 64, MSE", _unbalanced,
                  _unbalanced_batch, nn.MSELoss, 64, ("uniform", "time")),
        ModelSpec("small", "8 x [Linear(32,32)+GELU] + Linear(32,16), batch 64, MSE "
                  "(latency-bound)", _small, _small_batch, nn.MSELoss, 64),
        ModelSpec("tiny", "4 x [Linear(32,32)+GELU] + Linear(32,4), batch 16, MSE (CI)",
                  _tiny, _tiny_batch, nn.MSELoss, 16),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def balance_for(spec: ModelSpec, method: str, num_stages: int) -> list[int]:
    """Layers per stage for `num_stages` stages by `method` (uniform, params or time).

    "time" profiles each layer on one thread; compute it once and hand it to every rank, since
    two profiles can disagree.
    """
    model = spec.build()
    if method == "uniform":
        return split_sizes(len(model), num_stages)
    if method == "params":
        return balance_by_params(model, num_stages)
    if method == "time":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return balance_by_time(model, spec.batch()[0], num_stages)
        finally:
            torch.set_num_threads(threads)
    raise ValueError(f"unknown balance method {method!r}; use uniform, params or time")
