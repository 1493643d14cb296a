"""The demo: a character-level GPT learns Shakespeare with Pipe(schedule="1f1b") on two CPUs.

The model's output head is its token embedding (one Parameter, tied as in GPT-2), and the
split puts the embedding on stage 0 and the head on stage 1, so the tie crosses the pipeline.
On CPU each rank is a process of its own (threads of one process would share the GIL and one
intra-op thread pool); the run ends with the step time beside the plain model's on one thread
and on every core, and what the pipeline buys here and on accelerators.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from pipeline.examples.gpt import gpt, lm_loss
from pipeline.examples.text import CharTokenizer, load_text
from pipeline.launch import spawn
from pipeline.pipe import Pipe
from pipeline.planner import contention
from pipeline.planner.contention import MARK, Reading
from schedules import Timeline
from schedules.files import write_atomic

__all__ = ["main"]


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


class _Progress:
    """The training loop's progress: tqdm's bar on a terminal; elsewhere (a log, a pipe) a
    line about every tenth of the run, as a bar redrawn with carriage returns reads badly
    there. Only the printing rank shows it."""

    def __init__(self, total: int, show: bool) -> None:
        self.total, self.show = total, show
        self.terminal = show and sys.stdout.isatty()
        self.bar = tqdm(total=total, unit="step", file=sys.stdout, disable=not self.terminal,
                        dynamic_ncols=True)
        self.every = max(1, total // 10)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.terminal:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s",
                                     refresh=False)
            self.bar.update(1)
        elif self.show and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s",
                  flush=True)

    def close(self) -> None:
        self.bar.close()


class _Ranks:
    """What the demo's two ranks share: thread ranks in this process (`rank` None), or one
    process per rank over gloo, where rank 0 prints and the last rank holds the logits."""

    def __init__(self, rank: int | None) -> None:
        self.rank = rank

    @property
    def printer(self) -> bool:
        return self.rank in (None, 0)

    def say(self, *args: Any, **kwargs: Any) -> None:
        if self.printer:
            print(*args, **kwargs)
            sys.stdout.flush()

    def from_last(self, value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """`value`, computed on the last stage's rank, on every rank."""
        if self.rank is None:
            assert value is not None
            return value
        out = value if value is not None else torch.empty_like(like)
        dist.broadcast(out, src=1)
        return out

    def barrier(self) -> None:
        if self.rank is not None:
            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (one item in threads: this process holds every rank)."""
        if self.rank is None:
            return [value]
        out: list[Any] = [None, None]
        dist.all_gather_object(out, value)
        return out


@torch.no_grad()
def _evaluate(pipe: Pipe, ranks: _Ranks, x: torch.Tensor, y: torch.Tensor) -> float:
    pipe.eval()
    logits = pipe(x)  # on the last stage's rank (None on the others, over processes)
    loss = lm_loss(logits, y).reshape(1) if logits is not None else None
    pipe.train()
    return float(ranks.from_last(loss, torch.zeros(1)))


@torch.no_grad()
def _generate(pipe: Pipe, ranks: _Ranks, prompt: torch.Tensor, *, length: int, context: int,
              temperature: float, seed: int) -> torch.Tensor:
    """Sample `length` tokens after `prompt`, each token through the pipe (one micro-batch)."""
    pipe.eval()
    g = torch.Generator().manual_seed(seed)
    ids = prompt
    for _ in range(length):
        logits = pipe(ids[:, -context:], chunks=1)
        new = (torch.multinomial((logits[:, -1] / temperature).softmax(-1), 1, generator=g)
               if logits is not None else None)
        ids = torch.cat([ids, ranks.from_last(new, ids[:, :1])], dim=1)
    pipe.train()
    return ids


def _side_by_side(pipe: Pipe, ranks: _Ranks, plain: nn.Sequential | None, x: torch.Tensor,
                  y: torch.Tensor, rounds: int = 5
                  ) -> tuple[dict[str, float], dict[str, Reading]]:
    """Median step seconds of the Pipe and of the plain model on one thread and on every core,
    round after round (the plain model runs on rank 0 while the other rank waits), so the
    machine's noise hits all three alike; and for each, the CPU time its rounds got beside
    their wall time, the load around them and what other programs took meanwhile
    (pipeline/planner/contention.py)."""
    cores = os.cpu_count() or 1
    times: dict[str, list[float]] = {"pipe": [], "plain, 1 thread": [],
                                     f"plain, {cores} threads": []}
    cpu: dict[str, list[float]] = {name: [] for name in times}
    threads = {"pipe": 2, "plain, 1 thread": 1, f"plain, {cores} threads": cores}
    load_before = contention.load_average()
    # What other programs took over the whole stretch: the machine's busy time less every
    # rank's process (contention.Window); this process alone holds every thread rank.
    machine, own, wall = (contention.machine_busy(), contention.cpu_seconds(),
                          contention.wall_clock())

    def plain_step() -> None:
        assert plain is not None
        plain.zero_grad(set_to_none=True)
        torch.autograd.backward(lm_loss(plain(x), y))

    for i in range(rounds + 1):  # the first round warms up
        ranks.barrier()
        used = contention.cpu_seconds()
        start = time.perf_counter()
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, y, lm_loss)
        took = {"pipe": time.perf_counter() - start}
        got = {"pipe": contention.cpu_seconds() - used}
        ranks.barrier()
        if plain is not None:
            for n in (1, cores):
                torch.set_num_threads(n)
                name = f"plain, {n} thread{'s' if n > 1 else ''}"
                used = contention.cpu_seconds()
                start = time.perf_counter()
                plain_step()
                took[name] = time.perf_counter() - start
                got[name] = contention.cpu_seconds() - used
            torch.set_num_threads(1)
        ranks.barrier()
        if i:
            for name, seconds in took.items():
                times[name].append(seconds)
                cpu[name].append(got[name])
    # The Pipe's CPU time is every rank's (its other rank is another process, or a thread of
    # this one, counted already).
    cpu["pipe"] = [sum(round_) for round_ in zip(*ranks.gather(cpu["pipe"]), strict=True)]
    ours = sum(ranks.gather(contention.cpu_seconds() - own))
    after = contention.machine_busy()
    window = contention.Window(contention.wall_clock() - wall, ours,
                               None if machine is None or after is None else after - machine)
    load = (load_before, contention.load_average())
    # The Pipe's ranks have work outside 1f1b's bubble only: (p - 1) / (m + p - 1), p = 2.
    busy = {"pipe": 1 - 1 / (pipe.chunks + 1)}
    readings = {name: Reading(sum(v), sum(cpu[name]), threads[name], contention.cores(),
                              *load, busy.get(name, 1.0)).with_window(window)
                for name, v in times.items() if v}
    return {name: statistics.median(v) for name, v in times.items() if v}, readings


def _merged_timeline(pipe: Pipe, ranks: _Ranks) -> Timeline:
    """The last step's measured timeline, every rank on one clock (processes share the
    host's `perf_counter`; each timeline counts from its own step start, its meta's t0)."""
    timeline = pipe.last_timeline()
    parts = ranks.gather((timeline.events, float(timeline.meta["t0"])))
    if len(parts) == 1:
        return timeline
    t0 = min(start for _, start in parts)
    events = [replace(e, start=e.start + start - t0, end=e.end + start - t0)
              for evs, start in parts for e in evs]
    return Timeline(len(parts), tuple(sorted(events, key=lambda e: (e.rank, e.start))), "s",
                    {**timeline.meta, "t0": t0})


def _explain(args: argparse.Namespace, pipe: Pipe, ranks: _Ranks, speed: dict[str, float],
             readings: dict[str, Reading], bubble: float, x: torch.Tensor, y: torch.Tensor,
             total: int) -> None:
    """Say plainly what pipelining buys on this machine and on accelerators."""
    stage_params = [sum(p.numel() for p in part.parameters()) for part in pipe.partitions]
    pipe.track_memory = True  # one more step, counting what autograd saved too
    pipe.step(x, y, lm_loss)
    pipe.track_memory = False
    peaks = [s["peak_stashed_bytes"] for stats in ranks.gather(pipe.memory_stats())
             for s in stats]
    how = "2 processes (same-host links)" if args.ranks == "processes" else "2 threads"
    flag = {name: f" {MARK}" if r.contended() else "" for name, r in readings.items()}
    lines = [f"step time, median of 5 rounds side by side: Pipe over {how}, 1f1b, "
             f"m={args.chunks}: {speed['pipe'] * 1e3:.1f} ms{flag.get('pipe', '')}"]
    for name, seconds in speed.items():
        if name != "pipe":
            lines.append(f"  {name}: {seconds * 1e3:.1f} ms{flag.get(name, '')} (the Pipe's "
                         f"speedup {seconds / speed['pipe']:.2f}x"
                         f"{MARK if flag.get(name) or flag.get('pipe') else ''})")
    lines += ["  " + line for line in contention.describe(readings)]
    cores = os.cpu_count() or 1
    lines += [
        f"what the pipeline buys here: each rank holds one stage "
        f"({', '.join(f'{n:,}' for n in stage_params)} of {total:,} parameters, the tied "
        f"head's copy counted where it is held) and at most "
        f"{', '.join(f'{b / 2**20:.1f}' for b in peaks)} MiB of saved activations; on "
        f"this {cores}-core CPU two ranks use two cores, as the plain model does with "
        f"{cores} threads, so the plain model on every core is the fair comparison",
        f"on accelerators each stage has a device of its own: a model larger than one device "
        f"trains, and 1f1b leaves {bubble:.0%} of each device idle at m={args.chunks} (in "
        f"theory (p-1)/(m+p-1) = {1 / (args.chunks + 1):.0%}; more micro-batches shrink it). "
        f"Thread ranks (--ranks threads) are the path for several GPUs in one process; on CPU "
        f"they share the GIL and one intra-op pool"]
    ranks.say("\n".join(lines))


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
    parser.add_argument("--ranks", choices=("processes", "threads"), default="processes",
                        help="one process per rank (gloo, same-host links: the CPU path), or "
                             "one thread per rank in this process (the path for GPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    if args.depth < 2:
        parser.error(f"--depth must be >= 2 (got {args.depth}): each stage holds blocks")
    if args.ranks == "threads":
        _train(None, vars(args))
    else:
        spawn(_train, 2, vars(args), timeout=24 * 3600.0)
    return 0


def _train(rank: int | None, options: dict[str, Any]) -> None:
    """The demo on one rank (`rank` None: both ranks as threads of this process)."""
    args = argparse.Namespace(**options)
    ranks = _Ranks(rank)
    torch.manual_seed(args.seed)  # the same model on every rank
    # One intra-op thread per rank: the two ranks are the parallelism (2 cores, 2 devices).
    torch.set_num_threads(1)

    text = load_text()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    split = len(data) * 9 // 10  # the last tenth is held out
    train, held_out = data[:split], data[split:]
    config = {"vocab": tokenizer.vocab, "context": args.context, "width": args.width,
              "depth": args.depth, "heads": args.heads, "tied": not args.untied}
    model = gpt(dropout=args.dropout, **config)
    total = sum(p.numel() for p in model.parameters())  # the tied weight once
    # Stage 0: the embedding and half the blocks; stage 1: the rest, the final norm, the head.
    half = args.depth // 2
    pipe = Pipe(model, balance=[1 + half, args.depth - half + 2],
                devices=["cpu", "cpu"] if rank is None else None,
                chunks=args.chunks, schedule="1f1b", checkpoint="never")
    tie = ("its own weight (--untied)" if args.untied else
           "the embedding's weight, tied across stages 0 and 1")
    ranks.say(f"text: {len(text):,} characters, {tokenizer.vocab} distinct; GPT: "
              f"{total:,} parameters, width "
              f"{args.width}, {args.depth} blocks, context {args.context}; head = {tie}")
    ranks.say(f"Pipe {pipe.extra_repr()}, ranks: {args.ranks}")

    g = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    x_held, y_held = _windows(held_out, 4 * args.batch, args.context, g)
    held_before = _evaluate(pipe, ranks, x_held, y_held)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, args.steps))
    losses: list[float] = []
    progress = _Progress(args.steps, ranks.printer)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = _windows(train, args.batch, args.context, g)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y, lm_loss).item())
        pipe.clip_grad_norm_(1.0)  # over every stage, the tied weight once
        optimizer.step()
        schedule.step()
        tokens_per_s = step * x.numel() / (time.perf_counter() - start)
        progress.update(step, statistics.fmean(losses[-10:]), tokens_per_s)
    seconds = time.perf_counter() - start
    progress.close()
    k = max(1, min(20, args.steps // 5))
    held_after = _evaluate(pipe, ranks, x_held, y_held)
    ranks.say(f"{args.steps} steps in {seconds:.1f} s; training loss, mean of the first {k} "
              f"steps {statistics.fmean(losses[:k]):.4f} -> mean of the last {k} "
              f"{statistics.fmean(losses[-k:]):.4f}; held-out loss {held_before:.4f} -> "
              f"{held_after:.4f}")

    if args.sample:
        prompt = tokenizer.encode("CORIOLANUS:\n")[None]
        ids = _generate(pipe, ranks, prompt, length=args.sample, context=args.context,
                        temperature=0.8, seed=args.seed)
        ranks.say(f"--- sampled through the pipe (temperature 0.8) ---\n"
                  f"{tokenizer.decode(ids[0])}\n---")

    x, y = _windows(train, args.batch, args.context, g)
    plain = gpt(dropout=args.dropout, **config) if ranks.printer else None
    speed, readings = _side_by_side(pipe, ranks, plain, x, y)
    timeline = _merged_timeline(pipe, ranks)
    _explain(args, pipe, ranks, speed, readings, timeline.bubble_fraction, x, y, total)
    pipe.close()
    if not ranks.printer:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "demo-timeline.json", timeline.to_json())
    write_atomic(args.out / "demo-trace.json", json.dumps(timeline.to_chrome_trace()))
    # The step times and what the machine gave them, for a later look at a suspect figure.
    write_atomic(args.out / "demo-speed.json", json.dumps(
        {"step_s": speed, "contention": {k: r.to_dict() for k, r in readings.items()}},
        indent=2) + "\n")
    print(f"measured bubble {timeline.bubble_fraction:.1%}; timeline written to "
          f"{args.out / 'demo-timeline.json'} (Chrome trace: {args.out / 'demo-trace.json'}; "
          f"step times and their load: {args.out / 'demo-speed.json'})")
    _draw(timeline, args.out)


def _draw(timeline: Timeline, out: Path) -> None:
    """The measured step as text, and as a picture: an SVG by the visualizer's own renderer
    (written by hand, no extra package), the path and the command that redraws it last."""
    try:
        from viz import render_svg, render_text
    except ImportError:  # the visualizer is optional for the demo itself
        return
    print(render_text(timeline))
    svg = out / "demo-timeline.svg"
    write_atomic(svg, render_svg(timeline))
    source = out / "demo-timeline.json"
    print(f"picture of the measured step: {svg}\n"
          f"  redraw it: pipeviz {source} -o {svg}\n"
          f"  beside the simulator's prediction: pipeviz {source} --predicted "
          f"-o {out / 'demo-predicted.svg'}")


if __name__ == "__main__":
    raise SystemExit(main())
