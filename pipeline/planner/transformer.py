"""An analytic profile of a GPT-style transformer on a `Hardware` profile: what the search takes.

The model is Megatron-LM's GPT (Narayanan et al. 2021): a word and position embedding, `layers`
pre-norm transformer blocks (attention with `heads` heads, an MLP of 4 x hidden, GeLU, dropout,
no flash attention), a final layer norm and an output layer tied to the word embedding, trained
in bf16 with mixed-precision Adam. The profile has one layer per block plus the embedding
(first) and the head with the loss (last). Per micro-batch of `b` sequences of `s` tokens
(T = b s tokens, hidden h, a heads, vocabulary V), a block:

- multiplies 24 T h^2 + 4 T s h FLOPs forward (QKV 6 T h^2, scores and their use of V
  4 T s h, projection 2 T h^2, MLP 16 T h^2); its input gradient as many again plus the
  attention's second 4 T s h (which has no weights), its weight gradient 24 T h^2;
- moves, beside that, 22 T h bytes through memory whole on every tp rank (two layer norms,
  two bias-dropout-residual adds) and 16 T h + 9 a s T bytes that tp splits (bias and GeLU on
  4h, scale-mask-softmax and dropout of the scores), twice as much in backward;
- saves 34 T h + 5 a s T bytes for its backward (Korthikanti et al. 2022), of which
  10 T h stay whole under tp without sequence parallelism; its input is 2 T h bytes;
- all-reduces its 2 T h-byte output twice in forward and twice in backward under tp.

The embedding looks up and adds 11 T h bytes of traffic and all-reduces its output once under
tp (vocabulary split); the head multiplies 2 T h V FLOPs in each of forward, input gradient and
weight gradient, and its cross-entropy moves and keeps the logits in fp32 (split by vocabulary,
as with loss parallelism). Parameters are counted exactly (the paper's P = 12 l h^2 (1 +
13/12h + (V + s)/12 l h), plus the final layer norm), each as bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.planner.costs import LayerCosts, ModelProfile
from pipeline.planner.hardware import Hardware
from pipeline.planner.tensor import TensorSharding

__all__ = ["GPT", "MIXED_ADAM", "gpt_profile"]

MIXED_ADAM = 6.0
"""Mixed-precision Adam's state per byte of a bf16 parameter: fp32 master weights, first and
second moments (12 bytes per parameter over its 2), the planner's `optimizer=` for it. With the
bf16 gradient and the parameter itself: 16 bytes per parameter."""

_B = 2  # bytes per bf16 value


@dataclass(frozen=True)
class GPT:
    """A GPT-style model's shape: blocks, hidden size, heads, sequence length, vocabulary."""

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.seq, self.vocab) < 1:
            raise ValueError(f"a GPT's sizes must be >= 1 (got {self})")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads "
                             f"({self.heads})")

    @property
    def parameters(self) -> int:
        """Parameters, the tied output layer once."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (self.vocab + self.seq) * h + 2 * h

    def flops_per_step(self, batch: int, recomputed: float = 1.0) -> float:
        """Matmul FLOPs of a training step of `batch` sequences when a share `recomputed` of
        the blocks' forwards runs twice: Narayanan et al.'s equation (3), 96 B s l h^2 (1 +
        s/6h + V/16lh), at `recomputed` 1, and 72 B s l h^2 (1 + s/6h + V/12lh), the model's
        own FLOPs, at 0."""
        b, s, h, v, n = batch, self.seq, self.hidden, self.vocab, self.layers
        block = 24 * b * s * h * h * (1 + s / (6 * h))  # one block's forward
        return n * block * (3 + recomputed) + 6 * b * s * h * v


def gpt_profile(model: GPT, hardware: Hardware, *, batch: int,
                rows: Sequence[int]) -> tuple[ModelProfile, TensorSharding]:
    """The `ModelProfile` of `model` on `hardware` for a global batch of `batch` sequences,
    at micro-batches of each of `rows` sequences, and the `TensorSharding` Megatron's tensor
    parallelism gives it (see the module's notes). Plan it with `plan_profile(...,
    sharding=..., optimizer=MIXED_ADAM)`."""
    if batch < 1 or not rows or min(rows) < 1 or max(rows) > batch:
        raise ValueError(f"need batch >= 1 and micro-batch rows in 1..batch (got {batch}, "
                         f"{list(rows)})")
    h, a, s, v, n = model.hidden, model.heads, model.seq, model.vocab, model.layers
    by_rows = {r: _costs(model, hardware, r) for r in sorted(set(rows))}
    # Keys: 0 the word embedding (tied to the head), 1 the position embedding, then per block
    # 2 + 2i its split weights and biases, 3 + 2i what stays whole (layer norms, the biases
    # after row-parallel products); last the final layer norm.
    embed = ((0, v * h * _B, True), (1, s * h * _B, True))
    blocks = tuple(((2 + 2 * i, (12 * h * h + 7 * h) * _B, True),
                    (3 + 2 * i, 6 * h * _B, True)) for i in range(n))
    head = ((0, v * h * _B, True), (2 + 2 * n, 2 * h * _B, True))
    profile = ModelProfile(n + 2, (embed, *blocks, head), (0,) * (n + 2), by_rows, batch,
                           "analytic")
    one = by_rows[min(by_rows)]
    split = [0.0] + [_split_share(model, hardware, one.rows)] * n + [
        _head_split_share(model, hardware, one.rows)]
    kept = 10 * h / (34 * h + 5 * a * s)  # a block's saved bytes left whole under tp
    head_kept = 4 * h / (4 * h + 4 * v)
    sharding = TensorSharding(
        split_params=frozenset({0, *range(2, 2 + 2 * n, 2)}),
        split_time=tuple(split),
        split_saved=(0.0, *([1.0 - kept] * n), 1.0 - head_kept),
        forward_collectives=(1, *([2] * n), 0),
        backward_collectives=(0, *([2] * n), 1),
        message_bytes=tuple([float(s * h * _B)] * (n + 2)))
    return profile, sharding


def _block(model: GPT, b: int) -> tuple[float, float, float, float]:
    """A block's forward matmul FLOPs, attention-only matmul FLOPs, memory traffic that stays
    whole under tp, and traffic that tp splits, for `b` sequences."""
    h, s, a = model.hidden, model.seq, model.heads
    t = b * s
    return 24 * t * h * h, 4 * t * s * h, 22 * t * h, 16 * t * h + 9 * a * s * t


def _split_share(model: GPT, hw: Hardware, b: int) -> float:
    dense, attention, whole, split = _block(model, b)
    total = hw.compute_seconds(dense + attention, whole + split)
    return hw.compute_seconds(dense + attention, split) / total


def _head(model: GPT, b: int) -> tuple[float, float, float]:
    """The head's matmul FLOPs per pass, traffic that stays whole (its layer norm) and traffic
    tp splits (logits written in bf16, read and kept in fp32 by the loss)."""
    t = b * model.seq
    return 2 * t * model.hidden * model.vocab, 4 * t * model.hidden, 10 * t * model.vocab


def _head_split_share(model: GPT, hw: Hardware, b: int) -> float:
    flops, whole, split = _head(model, b)
    return hw.compute_seconds(flops, split) / hw.compute_seconds(flops, whole + split)


def _costs(model: GPT, hw: Hardware, b: int) -> LayerCosts:
    h, s, a, v, n = model.hidden, model.seq, model.heads, model.vocab, model.layers
    t = b * s
    dense, attention, whole, split = _block(model, b)
    f = hw.compute_seconds(dense + attention, whole + split)
    bi = hw.compute_seconds(dense + 2 * attention, 2 * (whole + split))
    bw = hw.compute_seconds(dense, 0.0)
    embed_f = hw.compute_seconds(0.0, 11 * t * h)
    flops, head_whole, head_split = _head(model, b)
    head_f = hw.compute_seconds(flops, head_whole + head_split)
    head_i = hw.compute_seconds(flops, 2 * (head_whole + head_split))
    head_w = hw.compute_seconds(flops, 0.0)
    forward = (embed_f, *([f] * n), head_f)
    backward_input = (2 * embed_f, *([bi] * n), head_i)
    backward_weight = (0.0, *([bw] * n), head_w)
    backward = tuple(i + w for i, w in zip(backward_input, backward_weight, strict=True))
    inputs = (8.0 * t, *([float(_B * t * h)] * n), float(_B * t * h))  # int64 token ids first
    saved = (float(t * h), *([float(34 * t * h + 5 * a * s * t)] * n),
             float(4 * t * h + 4 * t * v))
    return LayerCosts(b, forward, backward, backward_input, backward_weight, inputs, saved)
