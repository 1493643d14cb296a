"""`--suite lengths`: counted tokens per second on text of natural lengths, padded three ways.

The shipped play cut at each speech (bytes as tokens, at most `max_length`), a small
Llama-style model (RMSNorm, rotary causal attention, SwiGLU) over 2 processes under 1F1B, each
batch trained as (a) padded to the corpus's longest speech (what fixed-shape engines need),
(b) padded to its own longest, (c) cut into token micro-batches (`tokens=True`). The three take
turns batch by batch on the same processes, so the machine's noise falls on each alike.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe
from pipeline.launch import spawn
from pipeline.runtime.tokens import plan

__all__ = ["MODES", "LengthsSuite", "model", "render", "run_rank", "run_suite", "speeches"]

MODES = {"corpus": "(a) padded to the corpus's longest",
         "batch": "(b) padded to the batch's longest",
         "tokens": "(c) token micro-batches"}
_NUM_PROCESSES = 2


@dataclass(frozen=True)
class LengthsSuite:
    """The model's size, the batches, and how many rounds to time."""

    width: int = 128
    layers: int = 4
    heads: int = 4
    rows: int = 16
    chunks: int = 4
    max_length: int = 256
    batches: int = 8
    warmup: int = 1
    repeats: int = 3


def speeches(max_length: int) -> list[list[int]]:
    """The play cut at each speech (blank lines), as bytes, each at most `max_length`."""
    text = (resources.files("benchmarks") / "data" / "shakespeare.txt").read_text("utf-8")
    parts = [p.strip() for p in text.split("\n\n") if p.strip()]
    return [list(p.encode("utf-8"))[:max_length] for p in parts]


class _Embed(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = x
        return self.embed(ids), mask


class _Block(nn.Module):
    """Pre-norm causal attention with rotary positions, then a SwiGLU MLP. Right padding
    needs no mask under causal attention: a real token never sees a later pad."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.gate_up = nn.Linear(width, 8 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def _rotary(self, t: torch.Tensor) -> torch.Tensor:
        n, d = t.shape[-2], t.shape[-1] // 2
        freq = 10000.0 ** (-torch.arange(d, dtype=t.dtype, device=t.device) / d)
        angle = torch.arange(n, dtype=t.dtype, device=t.device)[:, None] * freq
        cos, sin = angle.cos(), angle.sin()
        a, b = t[..., :d], t[..., d:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = x
        rows, n, width = h.shape
        q, k, v = (t.view(rows, n, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(h)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(self._rotary(q), self._rotary(k), v, is_causal=True)
        h = h + self.out(a.transpose(1, 2).reshape(rows, n, width))
        gate, up = self.gate_up(self.norm2(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up), mask


class _Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.proj = nn.RMSNorm(width), nn.Linear(width, 256, bias=False)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits: torch.Tensor = self.proj(self.norm(x[0]))
        return logits


def model(suite: LengthsSuite) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Embed(suite.width),
                         *[_Block(suite.width, suite.heads) for _ in range(suite.layers)],
                         _Head(suite.width))


def _batch(rows: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    labels = torch.full_like(ids, -100)  # the next byte, where there is one
    labels[:, :-1] = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return ids, mask, labels


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def run_rank(rank: int, suite: LengthsSuite) -> dict[str, Any]:
    """Each mode's seconds and counted tokens over the timed rounds (every rank alike)."""
    torch.set_num_threads(1)
    corpus = speeches(suite.max_length)
    longest = max(len(s) for s in corpus)
    order = list(range(len(corpus)))
    random.Random(0).shuffle(order)
    batches = [[corpus[i] for i in order[b * suite.rows:(b + 1) * suite.rows]]
               for b in range(suite.batches)]
    net = model(suite)
    half = suite.layers // 2 + 1
    pipe = Pipe(net, balance=[half, suite.layers + 2 - half], chunks=suite.chunks,
                schedule="1f1b", checkpoint="never")
    seconds = dict.fromkeys(MODES, 0.0)
    counted = dict.fromkeys(MODES, 0)
    padded = dict.fromkeys(MODES, 0)
    for round_ in range(suite.warmup + suite.repeats):
        for rows in batches:
            for mode in MODES:  # in turn, batch by batch
                length = longest if mode == "corpus" else max(len(r) for r in rows)
                ids, mask, labels = _batch(rows, length)
                start = time.perf_counter()
                pipe.step((ids, mask), labels, _loss, loss_weight=lambda t: (t != -100).sum(),
                          tokens=mode == "tokens")
                elapsed = time.perf_counter() - start
                net.zero_grad(set_to_none=True)
                if round_ >= suite.warmup:
                    seconds[mode] += elapsed
                    counted[mode] += int(mask.sum())
                    padded[mode] += (int(sum(plan((ids, mask), suite.chunks, True).costs))
                                     if mode == "tokens" else ids.numel())
    pipe.close()
    return {"seconds": seconds, "counted": counted, "padded": padded, "longest": longest}


def run_suite(suite: LengthsSuite) -> dict[str, Any]:
    """The suite on 2 spawned gloo processes; rank 0's figures with the suite's settings."""
    results = spawn(run_rank, _NUM_PROCESSES, suite, timeout=3600.0)
    out = results[0]
    out["tokens_per_s"] = {m: out["counted"][m] / out["seconds"][m] for m in MODES}
    out["suite"] = asdict(suite)
    return dict(out)


def render(result: dict[str, Any], command: str, machine: str) -> str:
    """The markdown table of `result`, with the command and the machine."""
    rate = result["tokens_per_s"]
    lines = ["| mode | counted tokens/s | padding computed | vs (a) |", "|---|---|---|---|"]
    for mode, label in MODES.items():
        waste = 1 - result["counted"][mode] / result["padded"][mode]
        speed = rate[mode] / rate["corpus"]
        lines.append(f"| {label} | {rate[mode]:,.0f} | {waste:.0%} | {speed:.2f}x |")
    s = result["suite"]
    lines += ["", f"(c) vs (b): {rate['tokens'] / rate['batch']:.2f}x. Longest speech "
              f"{result['longest']} bytes; {s['batches']} batches of {s['rows']} rows, "
              f"{s['chunks']} micro-batches, 1F1B on 2 processes; width {s['width']}, "
              f"{s['layers']} blocks; {s['repeats']} timed rounds after {s['warmup']}.",
              "", f"Command: `{command}`. Machine: {machine}."]
    return "\n".join(lines)
