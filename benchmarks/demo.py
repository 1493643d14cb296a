"""The demo: a character-level GPT learns Shakespeare with Pipe(schedule="1f1b") on two CPUs.

The model's output head is its token embedding (one Parameter, tied as in GPT-2), and the
split puts the embedding on stage 0 and the head on stage 1, so the tie crosses the pipeline.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from benchmarks.gpt import gpt, lm_loss
from pipeline.pipe import Pipe
from schedules import Timeline
from schedules.files import write_atomic

__all__ = ["CharTokenizer", "load_text", "main"]


def load_text() -> str:
    """The shipped public-domain text (benchmarks/data/shakespeare.txt)."""
    return (resources.files("benchmarks") / "data" / "shakespeare.txt").read_text("utf-8")


class CharTokenizer:
    """One id per distinct character of a text, in sorted order."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._ids[c] for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def _windows(data: torch.Tensor, rows: int, context: int,
             g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` random contiguous windows: inputs (rows, context), targets shifted by one."""
    starts = torch.randint(len(data) - context, (rows, 1), generator=g)
    window = data[starts + torch.arange(context + 1)]
    return window[:, :-1], window[:, 1:]


def _lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first tenth (at most 20 steps), then cosine decay to 0.1."""
    warmup = max(1, min(20, steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _progress(step: int, total: int, loss: float, tokens_per_s: float, width: int = 30) -> str:
    done = int(width * step / total)
    return (f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  "
            f"{tokens_per_s:,.0f} tokens/s")


@torch.no_grad()
def _evaluate(pipe: Pipe, x: torch.Tensor, y: torch.Tensor) -> float:
    pipe.eval()
    loss = lm_loss(pipe(x), y).item()
    pipe.train()
    return loss


@torch.no_grad()
def _generate(pipe: Pipe, prompt: torch.Tensor, *, rows: int, length: int, context: int,
              temperature: float, seed: int) -> torch.Tensor:
    """Sample `length` tokens after `prompt` for `rows` rows, each token through the pipe."""
    pipe.eval()
    g = torch.Generator().manual_seed(seed)
    ids = prompt.expand(rows, -1)
    for _ in range(length):
        logits = pipe(ids[:, -context:])[:, -1] / temperature
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=g)], dim=1)
    pipe.train()
    return ids


def _side_by_side(pipe: Pipe, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                  rounds: int = 5) -> tuple[float, float]:
    """Median step seconds of the Pipe and the plain model, alternating so noise hits both."""

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        torch.autograd.backward(lm_loss(model(x), y))

    def piped() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, y, lm_loss)

    times: dict[str, list[float]] = {"pipe": [], "plain": []}
    for i in range(rounds + 1):
        for name, fn in (("pipe", piped), ("plain", plain)):
            start = time.perf_counter()
            fn()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["pipe"]), statistics.median(times["plain"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="windows per step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--context", type=int, default=64, help="characters per window")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks (>= 2)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=6e-3, help="peak learning rate")
    parser.add_argument("--sample", type=int, default=200, help="characters to generate")
    parser.add_argument("--untied", action="store_true",
                        help="give the head its own weight instead of the embedding's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    if args.depth < 2:
        parser.error(f"--depth must be >= 2 (got {args.depth}): each stage holds blocks")
    torch.manual_seed(args.seed)
    # One intra-op thread per rank: the two ranks are the parallelism (2 cores, 2 devices).
    torch.set_num_threads(1)

    text = load_text()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    split = len(data) * 9 // 10  # the last tenth is held out
    train, held_out = data[:split], data[split:]
    model = gpt(tokenizer.vocab, context=args.context, width=args.width, depth=args.depth,
                heads=args.heads, dropout=args.dropout, tied=not args.untied)
    # Stage 0: the embedding and half the blocks; stage 1: the rest, the final norm, the head.
    half = args.depth // 2
    pipe = Pipe(model, balance=[1 + half, args.depth - half + 2], devices=["cpu", "cpu"],
                chunks=args.chunks, schedule="1f1b", checkpoint="never")
    tie = ("its own weight (--untied)" if args.untied else
           "the embedding's weight, tied across stages 0 and 1")
    print(f"text: {len(text):,} characters, {tokenizer.vocab} distinct; GPT: "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, width {args.width}, "
          f"{args.depth} blocks, context {args.context}; head = {tie}")
    print(f"Pipe {pipe.extra_repr()}")

    g = torch.Generator().manual_seed(args.seed)
    x_held, y_held = _windows(held_out, 4 * args.batch, args.context, g)
    held_before = _evaluate(pipe, x_held, y_held)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, args.steps))
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = _windows(train, args.batch, args.context, g)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y, lm_loss).item())
        pipe.clip_grad_norm_(1.0)  # over every stage, the tied weight once
        optimizer.step()
        schedule.step()
        tokens_per_s = step * x.numel() / (time.perf_counter() - start)
        sys.stdout.write(_progress(step, args.steps, statistics.fmean(losses[-10:]),
                                   tokens_per_s))
        sys.stdout.flush()
    seconds = time.perf_counter() - start
    k = max(1, min(20, args.steps // 5))
    print(f"\n{args.steps} steps in {seconds:.1f} s; training loss, mean of the first {k} "
          f"steps {statistics.fmean(losses[:k]):.4f} -> mean of the last {k} "
          f"{statistics.fmean(losses[-k:]):.4f}; held-out loss {held_before:.4f} -> "
          f"{_evaluate(pipe, x_held, y_held):.4f}")

    if args.sample:
        prompt = tokenizer.encode("CORIOLANUS:\n")[None]
        ids = _generate(pipe, prompt, rows=args.chunks, length=args.sample,
                        context=args.context, temperature=0.8, seed=args.seed)
        print(f"--- sampled through the pipe (temperature 0.8) ---\n"
              f"{tokenizer.decode(ids[0])}\n---")

    x, y = _windows(train, args.batch, args.context, g)
    pipe_s, plain_s = _side_by_side(pipe, model, x, y)
    print(f"step time: Pipe 2 x cpu, 1f1b, m={args.chunks}: {pipe_s * 1e3:.1f} ms; "
          f"plain model, 1 thread: {plain_s * 1e3:.1f} ms; speedup {plain_s / pipe_s:.2f}x")
    timeline = pipe.last_timeline()
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "demo-timeline.json", timeline.to_json())
    write_atomic(args.out / "demo-trace.json", json.dumps(timeline.to_chrome_trace()))
    print(f"measured bubble {timeline.bubble_fraction:.1%}; timeline written to "
          f"{args.out / 'demo-timeline.json'} (Chrome trace: {args.out / 'demo-trace.json'})")
    _draw(timeline)
    return 0


def _draw(timeline: Timeline) -> None:
    try:
        from viz import render_text
    except ImportError:  # the visualizer is optional for the demo itself
        return
    print(render_text(timeline))


if __name__ == "__main__":
    raise SystemExit(main())
