"""`--suite lengths`: counted tokens per second on text of natural lengths, padded three ways.

The shipped play cut at each speech (bytes as tokens, at most `max_length`), a small
Llama-style model (RMSNorm, rotary causal attention, SwiGLU) over 2 processes under 1F1B, each
batch trained as (a) padded to the corpus's longest speech (what fixed-shape engines need),
(b) padded to its own longest, (c) cut into token micro-batches (`tokens=True`), and by
torch.distributed.pipelining's Schedule1F1B on the same split and the batches of (a) (its
`PipelineStage` fixes its shapes at its first step, so it has no (b)). The four take turns
batch by batch on the same processes, so the machine's noise falls on each alike.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from benchmarks.lengths_torch import check, step, torch_peer
from pipeline import Pipe
from pipeline.examples.text import load_text
from pipeline.launch import spawn
from pipeline.runtime.tokens import plan

__all__ = ["MODES", "PEER", "LengthsSuite", "model", "render", "run_rank", "run_suite", "speeches"]

MODES = {"corpus": "(a) padded to the corpus's longest",
         "batch": "(b) padded to the batch's longest",
         "tokens": "(c) token micro-batches"}
PEER = {"torch": "torch.distributed.pipelining, padded as (a)"}
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
    text = load_text()
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
    balance = [half, suite.layers + 2 - half]
    pipe = Pipe(net, balance=balance, chunks=suite.chunks, schedule="1f1b", checkpoint="never")
    # Torch's stages talk over a group of their own: neither pipeline can take the other's
    # messages.
    peer, peer_loss = torch_peer(net, balance, rank=rank, chunks=suite.chunks,
                                 group=dist.new_group(list(range(_NUM_PROCESSES))))

    def ours(x: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor,
             tokens: bool = False) -> torch.Tensor:
        return pipe.step(x, labels, _loss, loss_weight=lambda t: (t != -100).sum(),
                         tokens=tokens)

    ids, mask, labels = _batch(batches[0], longest)  # the same work: one batch of (a) each
    checked = check(pipe, peer, peer_loss, net, (ids, mask), labels, ours)
    seconds = dict.fromkeys([*MODES, *PEER], 0.0)
    counted = dict.fromkeys([*MODES, *PEER], 0)
    padded = dict.fromkeys([*MODES, *PEER], 0)
    for round_ in range(suite.warmup + suite.repeats):
        for rows in batches:
            for mode in [*MODES, *PEER]:  # in turn, batch by batch
                length = max(len(r) for r in rows) if mode in ("batch", "tokens") else longest
                ids, mask, labels = _batch(rows, length)
                peer_loss.total = int((labels != -100).sum())  # torch's loss weighs by it
                start = time.perf_counter()
                if mode in PEER:
                    step(peer, (ids, mask), labels)
                else:
                    ours((ids, mask), labels, mode == "tokens")
                elapsed = time.perf_counter() - start
                net.zero_grad(set_to_none=True)
                if round_ >= suite.warmup:
                    seconds[mode] += elapsed
                    counted[mode] += int(mask.sum())
                    padded[mode] += (int(sum(plan((ids, mask), suite.chunks, True).costs))
                                     if mode == "tokens" else ids.numel())
    pipe.close()
    return {"seconds": seconds, "counted": counted, "padded": padded, "longest": longest,
            "torch_check": checked}


def run_suite(suite: LengthsSuite) -> dict[str, Any]:
    """The suite on 2 spawned gloo processes; rank 0's figures with the suite's settings, the
    ratios to torch's peer, and the one-batch check that torch's work is ours (both losses,
    from the last stage's rank; the largest gradient difference over the ranks)."""
    results = spawn(run_rank, _NUM_PROCESSES, suite, timeout=3600.0)
    out = results[0]
    out["tokens_per_s"] = {m: out["counted"][m] / out["seconds"][m] for m in out["seconds"]}
    rate = out["tokens_per_s"]
    out["vs_torch"] = {m: rate[m] / rate["torch"] for m in MODES}
    checks = [r["torch_check"] for r in results]
    last = checks[-1]
    out["torch_check"] = {"ours_loss": last["ours_loss"], "torch_loss": last["torch_loss"],
                          "max_grad_diff": max(c["max_grad_diff"] for c in checks),
                          "compared": sum(c["compared"] for c in checks)}
    out["suite"] = asdict(suite)
    return dict(out)


def render(result: dict[str, Any], command: str, machine: str) -> str:
    """The markdown table of `result`, with the command and the machine."""
    rate = result["tokens_per_s"]
    rows = {**MODES, **{k: v for k, v in PEER.items() if k in rate}}
    lines = ["| mode | counted tokens/s | padding computed | vs (a) |", "|---|---|---|---|"]
    for mode, label in rows.items():
        waste = 1 - result["counted"][mode] / result["padded"][mode]
        speed = rate[mode] / rate["corpus"]
        lines.append(f"| {label} | {rate[mode]:,.0f} | {waste:.0%} | {speed:.2f}x |")
    s = result["suite"]
    lines += ["", f"(c) vs (b): {rate['tokens'] / rate['batch']:.2f}x. Longest speech "
              f"{result['longest']} bytes; {s['batches']} batches of {s['rows']} rows, "
              f"{s['chunks']} micro-batches, 1F1B on 2 processes; width {s['width']}, "
              f"{s['layers']} blocks; {s['repeats']} timed rounds after {s['warmup']}."]
    if "torch" in rate:
        c = result["torch_check"]
        lines += ["", f"(c) vs torch: {rate['tokens'] / rate['torch']:.2f}x; (a) vs torch: "
                  f"{rate['corpus'] / rate['torch']:.2f}x. Torch's peer: Schedule1F1B over "
                  f"`PipelineStage`s holding the same layers, on the batches of (a); one batch "
                  f"through both: loss {c['ours_loss']:.6f} (ours), {c['torch_loss']:.6f} "
                  f"(torch), gradients within {c['max_grad_diff']:.1e}. No torch (b): a "
                  f"`PipelineStage` fixes its shapes at its first step."]
    lines += ["", f"Command: `{command}`. Machine: {machine}."]
    return "\n".join(lines)
