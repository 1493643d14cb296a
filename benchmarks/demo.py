"""The demo: train a residual MLP with Pipe(schedule="1f1b") on two CPU devices, beside one."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from pipeline.pipe import Pipe
from schedules import Timeline

__all__ = ["Residual", "demo_model", "main"]


class Residual(nn.Module):
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


def demo_model(width: int = 256, depth: int = 8, classes: int = 10) -> nn.Sequential:
    """Input projection, `depth` residual blocks, a classifier: all flat in one nn.Sequential."""
    return nn.Sequential(nn.Linear(32, width), *[Residual(width, 4 * width) for _ in range(depth)],
                         nn.LayerNorm(width), nn.Linear(width, classes))


def _data(batch: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A learnable synthetic task: the class is the argmax of a fixed random projection.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 32, generator=g)
    proj = torch.randn(32, classes, generator=torch.Generator().manual_seed(0))
    return x, (x @ proj).argmax(-1)


def _bar(step: int, total: int, loss: float, width: int = 30) -> str:
    done = int(width * step / total)
    return f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}"


def _side_by_side(pipe: Pipe, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                  rounds: int = 5) -> tuple[float, float]:
    """Median step seconds of the Pipe and the plain model, alternating so noise hits both."""
    loss_fn = nn.CrossEntropyLoss()

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    def piped() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, y, loss_fn)

    times: dict[str, list[float]] = {"pipe": [], "plain": []}
    for i in range(rounds + 1):
        for name, fn in (("pipe", piped), ("plain", plain)):
            start = time.perf_counter()
            fn()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["pipe"]), statistics.median(times["plain"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    # One intra-op thread per rank: the two ranks are the parallelism (2 cores, 2 devices).
    torch.set_num_threads(1)
    model = demo_model(args.width)
    pipe = Pipe(model, balance="params", stages=2, devices=["cpu", "cpu"], chunks=args.chunks,
                schedule="1f1b", checkpoint="never")
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters in "
          f"{len(model)} layers; Pipe {pipe.extra_repr()}")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=2e-3)
    loss_fn = nn.CrossEntropyLoss()
    first = last = 0.0
    for step in range(1, args.steps + 1):
        x, y = _data(args.batch, 10, seed=step)
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(x, y, loss_fn).item()
        optimizer.step()
        first = first or loss
        last = loss
        sys.stdout.write(_bar(step, args.steps, loss))
        sys.stdout.flush()
    print(f"\nloss {first:.4f} -> {last:.4f}")
    x, y = _data(args.batch, 10, seed=10_000)
    pipe_s, plain_s = _side_by_side(pipe, model, x, y)
    print(f"step time: Pipe 2 x cpu, 1f1b, m={args.chunks}: {pipe_s * 1e3:.1f} ms; "
          f"plain model, 1 thread: {plain_s * 1e3:.1f} ms; speedup {plain_s / pipe_s:.2f}x")
    timeline = pipe.last_timeline()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo-timeline.json").write_text(timeline.to_json())
    (args.out / "demo-trace.json").write_text(json.dumps(timeline.to_chrome_trace()))
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
