"""Token micro-batches' models and batches, and the functions tests/pipeline/test_traced_dist.py
runs on spawned gloo ranks: 2 pipeline ranks, and dp x pp = 2 x 2 (importable by child
processes)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe
from tests.pipeline.reference import grads_equal

__all__ = ["HF_TOL", "VOCAB", "assert_same", "llama", "masked_lm", "padded_batch", "token_loss",
           "tokens_dp", "tokens_pp"]

VOCAB = 13
# float64: trimmed micro-batches multiply matrices of other shapes than the padded batch's, so
# sums run in another order; in float64 that rounding is ~1e-16 relative, far below 1e-10.
TOL = {"rtol": 1e-10, "atol": 1e-12}
# Hugging Face computes its loss in float32 even for a float64 model (it upcasts the logits),
# so the loss, and the gradient it sends back into the float64 logits, carry float32 rounding:
# relative ~1e-7 of each term, on gradients of order 1e-2 (absolute ~1e-9).
HF_TOL = {"rtol": 1e-5, "atol": 1e-8}


class Embed(nn.Module):
    """(ids, mask) -> (hidden, mask)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = x
        return self.embed(ids), mask


class Attend(nn.Module):
    """Attention over the unmasked keys (bidirectional), with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = x
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(mask[:, None, :] == 0, torch.finfo(scores.dtype).min)
        return h + self.out(scores.softmax(-1) @ v), mask


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, VOCAB)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.proj(torch.tanh(x[0]))


def masked_lm(width: int = 8, blocks: int = 3, seed: int = 0) -> nn.Sequential:
    """An nn.Sequential taking (ids, mask), in float64."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(width), *[Attend(width) for _ in range(blocks)],
                         Head(width)).double()


def padded_batch(lengths: list[int], length: int | None = None, seed: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, a trailing-padding mask and labels (-100 on padding) for rows of `lengths`."""
    g = torch.Generator().manual_seed(seed)
    length = length or max(lengths)
    mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(lengths), length), generator=g) * mask
    labels = torch.randint(0, VOCAB, ids.shape, generator=g).masked_fill(mask == 0, -100)
    return ids, mask, labels


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def llama(seed: int = 0) -> nn.Module:
    """A small Hugging Face Llama in float64 (converted before it is split)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).double()


def assert_same(model: nn.Module, reference: nn.Module, loss: torch.Tensor,
                expected: torch.Tensor, what: str, tol: dict[str, float] | None = None) -> int:
    """The loss and every gradient held here equal the reference's; returns how many."""
    return grads_equal(model, reference, loss, expected, what, tol or TOL)


def tokens_pp(rank: int, schedules: list[str]) -> dict[str, Any]:
    """2 pipeline ranks, token micro-batches: an (ids, mask) nn.Sequential and a Llama split
    from its graph (its own out.loss), against the unsplit model on the padded batch; every
    rank passes the batch (the last cuts its target as the first cuts the input)."""
    checked = 0
    lengths = [11, 2, 5, 9, 3, 7, 1, 4]
    for schedule in schedules:
        model = masked_lm()
        reference = copy.deepcopy(model)
        pipe = Pipe(model, balance=[3, 2], chunks=4, schedule=schedule, tokens=True)
        ids, mask, labels = padded_batch(lengths, 12)
        loss = pipe.step((ids, mask), labels, token_loss,
                         loss_weight=lambda t: (t != -100).sum())
        expected = token_loss(reference((ids, mask)), labels)
        expected.backward()
        checked += assert_same(model, reference, loss, expected, f"sequential/{schedule}")
        pipe.close()
    model, reference = llama(), llama()
    ids, mask, labels = padded_batch(lengths, 12)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}
    pipe = Pipe(model, example_inputs=inputs, split_points=["model.layers.2"], chunks=4,
                schedule=schedules[0], tokens=True)
    loss = pipe.step(inputs, None, lambda out, y: out.loss)
    expected = reference(**inputs).loss
    expected.backward()
    checked += assert_same(model, reference, loss, expected, "llama", HF_TOL)
    pipe.close()
    return {"checked": checked, "loss": float(loss)}


def _whole(shards: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The replicas' batches as one: rows concatenated, each padded (zeros; labels -100) to
    the longest padded length."""
    length = max(s[0].shape[1] for s in shards)
    parts = []
    for k in range(len(shards[0])):
        fill = -100 if k == 2 else 0
        parts.append(torch.cat([F.pad(s[k], (0, length - s[k].shape[1]), value=fill)
                                for s in shards]))
    return tuple(parts)


# Each replica its own batch: other rows, other lengths, padded to another length.
DP_LENGTHS = [([11, 2, 5, 9, 3, 7, 1, 4], 12), ([6, 3, 8, 2, 5, 1], 9)]


def tokens_dp(rank: int, schedules: list[str]) -> dict[str, Any]:
    """dp x pp = 2 x 2, token micro-batches: replica 0 trains on 8 rows padded to 12, replica
    1 on 6 rows padded to 9, in one step; the loss and every gradient (averaged over the
    replicas by dp's rule: each replica's token-mean weighted by its share of the global
    tokens) equal the unsplit model's on the whole padded batch (both batches' rows, padded to
    12). An (ids, mask) nn.Sequential under each schedule, and a Llama split from its graph
    with its own out.loss (which weights itself by the tokens it counts)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    shards = [padded_batch(lengths, length, seed=1 + r)
              for r, (lengths, length) in enumerate(DP_LENGTHS)]
    ids, mask, labels = shards[replica]
    whole = _whole(shards)
    checked, losses = 0, []
    for schedule in schedules:
        model = masked_lm()
        reference = copy.deepcopy(model)
        pipe = Pipe(model, balance=[3, 2], chunks=4, schedule=schedule, tokens=True,
                    mesh=mesh)
        loss = pipe.step((ids, mask), labels, token_loss,
                         loss_weight=lambda t: (t != -100).sum())
        expected = token_loss(reference(whole[:2]), whole[2])
        expected.backward()
        checked += assert_same(model, reference, loss, expected, f"dp/sequential/{schedule}")
        losses.append(float(loss))
        pipe.close()
    model, reference = llama(), llama()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}
    pipe = Pipe(model, example_inputs=inputs, split_points=["model.layers.2"], chunks=4,
                schedule=schedules[0], tokens=True, mesh=mesh)
    loss = pipe.step(inputs, None, lambda out, y: out.loss)  # every rank holds first or last
    expected = reference(input_ids=whole[0], attention_mask=whole[1], labels=whole[2],
                         use_cache=False).loss
    expected.backward()
    checked += assert_same(model, reference, loss, expected, "dp/llama", HF_TOL)
    losses.append(float(loss))
    pipe.close()
    return {"checked": checked, "losses": losses}
