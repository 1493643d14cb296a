"""`schedule="auto"` on unequal stages: against the best fixed schedule and the ideal pipeline.

`python -m benchmarks.auto_schedule` prints, per ranks p and micro-batches m, the simulated
makespan of `auto` (synthesised for the stages' costs, under 1F1B's memory: p micro-batches
per rank) over the best fixed one-stage-per-rank schedule within that memory, and over the
ideal (the busiest rank's work, no bubble). The model: an embedding, 4p equal blocks and a
head `--head` times a block (F and I), with the head's W `--head-w` times its I (a wide output
projection's weight gradient); the blocks split so that the busiest stage works least (the
head's stage gets fewer: uneven layer counts); transfers of `--comm` blocks. With
`--measure`, it also times steps of `Pipe` (threads, CPU) for a real model of that shape
(Linear + GELU blocks of `--width`, a head Linear `--head` times wider), under `auto`
synthesised from a per-layer profile and under the fixed schedule the same profile ranks
best: median seconds of `--steps` steps after one warm-up. With `--measure --sleep MS`, the
stages are made of the model's costs in sleeps of MS milliseconds a block unit
(benchmarks/auto_sleep.py): `auto`, timing its own first step, against every fixed schedule
within the same memory, one step of each per round, with the simulated figures beside them;
`--transport processes` runs those cells with each rank a process (gloo on loopback,
benchmarks/auto_sleep_procs.py) instead of a thread, so that the ranks share no GIL.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from schedules import Costs, Op, Schedule
from schedules.auto import search

__all__ = ["TRANSPORTS", "balanced", "main", "measured", "simulated", "stage_costs"]

TRANSPORTS = ("threads", "processes")  # how --measure --sleep runs the pipeline's ranks


def stage_costs(blocks: Sequence[int], *, head: float, head_w: float, comm: float) -> Costs:
    """Per-stage costs in block units (a block: F = I = W = 1): `blocks[s]` blocks on stage
    s, an embedding (F 0.5, I 0, W 0.5) on the first, the head (F = I = `head`, W = `head *
    head_w`) on the last."""
    f = [float(n) for n in blocks]
    i, w = list(f), list(f)
    f[0] += 0.5
    w[0] += 0.5
    f[-1] += head
    i[-1] += head
    w[-1] += head * head_w
    return Costs(forward=f, backward_input=i, backward_weight=w,
                 backward=[a + b for a, b in zip(i, w, strict=True)], comm=comm)


def balanced(num_ranks: int, num_blocks: int, *, head: float, head_w: float) -> list[int]:
    """Blocks per stage that make the busiest stage's F + I + W least (the head's stage gets
    fewer blocks: uneven layer counts), the first such split in lexicographic order."""
    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations_with_replacement(range(num_blocks + 1),
                                                        num_ranks - 1):
        edges = [0, *cuts, num_blocks]
        counts = [edges[s + 1] - edges[s] for s in range(num_ranks)]
        work = [3.0 * n for n in counts]
        work[0] += 1.0
        work[-1] += head * (2 + head_w)
        if best is None or max(work) < best[0]:
            best = (max(work), counts)
    assert best is not None
    return best[1]


def simulated(num_ranks: int, num_microbatches: int, costs: Costs) -> dict[str, Any]:
    """auto's makespan, the best fixed schedule's and the ideal (busiest rank's work)."""
    found = search(num_ranks, num_microbatches, costs, memory_limit=num_ranks)
    best = found.best_fixed
    assert best is not None  # zb-h1-tight and 1f1b hold at most p on every rank
    ideal = max(num_microbatches * sum(costs.of(op, r) for op in (Op.F, Op.I, Op.W))
                for r in range(num_ranks))
    return {"p": num_ranks, "m": num_microbatches, "auto": found.makespan,
            "chosen": found.chosen, "fixed": best[0], "fixed_makespan": best[1],
            "ideal": ideal, "schedule": found.schedule}


def measured(blocks: Sequence[int], num_microbatches: int, *, width: int, head: int,
             rows: int, steps: int) -> dict[str, Any]:
    """Median step seconds of `Pipe` under `auto` (synthesised from a per-layer profile summed
    per stage) and under the fixed schedule that profile ranks best."""
    import torch
    from torch import nn

    from pipeline.planner.costs import profile_model

    torch.manual_seed(0)
    p, m = len(blocks), num_microbatches
    model = nn.Sequential(nn.Linear(width // 4, width),
                          *[nn.Sequential(nn.Linear(width, width), nn.GELU())
                            for _ in range(sum(blocks))],
                          nn.Linear(width, head * width))
    x, y = torch.randn(rows * m, width // 4), torch.randn(rows * m, head * width)
    loss_fn = nn.MSELoss()
    layers = profile_model(model, x, y, loss_fn, rows=[rows]).at(rows)
    balance = list(blocks)
    balance[0] += 1  # the embedding
    balance[-1] += 1  # the head
    bounds = [sum(balance[:s]) for s in range(p + 1)]

    def per_stage(values: tuple[float, ...]) -> list[float]:
        return [sum(values[bounds[s]:bounds[s + 1]]) for s in range(p)]

    costs = Costs(forward=per_stage(layers.forward), backward=per_stage(layers.backward),
                  backward_input=per_stage(layers.backward_input),
                  backward_weight=per_stage(layers.backward_weight))
    found = search(p, m, costs, memory_limit=p)
    fixed = found.best_fixed
    assert fixed is not None
    out: dict[str, Any] = {"p": p, "m": m, "chosen": found.chosen, "fixed": fixed[0],
                           "sim_ratio": found.makespan / fixed[1]}
    for label, arg in (("auto", found.schedule), ("fixed", fixed[0])):
        out[f"{label}_s"] = _median_step(model, balance, m, arg, x, y, loss_fn, steps)
    return out


def _median_step(model: Any, balance: list[int], chunks: int, schedule: str | Schedule,
                 x: Any, y: Any, loss_fn: Any, steps: int) -> float:
    from pipeline import Pipe

    pipe = Pipe(model, balance, chunks=chunks, schedule=schedule)
    try:
        times = []
        for _ in range(steps + 1):  # the first is a warm-up
            start = time.perf_counter()
            pipe.step(x, y, loss_fn)
            times.append(time.perf_counter() - start)
    finally:
        pipe.close()
    return statistics.median(times[1:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_schedule",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4],
                        help="pipeline ranks p, one table row group each (default 2 4)")
    parser.add_argument("--microbatches", type=int, nargs="*", default=[4, 8, 16, 32],
                        help="micro-batch counts m (default 4 8 16 32)")
    parser.add_argument("--head", type=float, default=4.0,
                        help="the head's F and I cost in blocks (default 4)")
    parser.add_argument("--head-w", type=float, default=2.0,
                        help="the head's W cost as a multiple of its I (default 2)")
    parser.add_argument("--comm", type=float, default=0.25,
                        help="a transfer's cost in blocks (default 0.25)")
    parser.add_argument("--measure", action="store_true",
                        help="also time Pipe's steps (threads, CPU) for a model of that shape")
    parser.add_argument("--steps", type=int, default=5,
                        help="with --measure: timed steps per cell after a warm-up (default 5)")
    parser.add_argument("--width", type=int, default=256,
                        help="with --measure: a block's hidden width (default 256)")
    parser.add_argument("--sleep", type=float, default=None, metavar="MS",
                        help="with --measure: stages that sleep their costs, MS milliseconds a "
                             "block unit, instead of matmuls (e.g. 3)")
    parser.add_argument("--transport", choices=TRANSPORTS, default="threads",
                        help="with --measure --sleep: the ranks as threads of this process "
                             "or as processes (gloo on loopback); default threads")
    args = parser.parse_args(argv)
    if args.sleep is not None and (not args.measure or args.sleep <= 0):
        parser.error(f"--sleep sets the block unit of --measure's sleep stages in milliseconds: "
                     f"it needs --measure and a value > 0 (got {args.sleep}, measure "
                     f"{args.measure}); e.g. --measure --sleep 3")
    if args.transport != "threads" and args.sleep is None:
        parser.error(f"--transport {args.transport} runs the sleep stages' cells over "
                     f"processes: it needs --measure --sleep MS (got --sleep "
                     f"{args.sleep}, measure {args.measure}); e.g. --measure --sleep 3 "
                     f"--transport {args.transport}")
    print(f"head {args.head} blocks, its W {args.head_w}x its I, comm {args.comm}; memory: p "
          f"micro-batches per rank")
    print("| p | blocks | m | auto | best fixed | auto / best fixed | auto / ideal | chosen |")
    print("|---|---|---|---|---|---|---|---|")
    for p in args.ranks:
        blocks = balanced(p, 4 * p, head=args.head, head_w=args.head_w)
        costs = stage_costs(blocks, head=args.head, head_w=args.head_w, comm=args.comm)
        for m in args.microbatches:
            r = simulated(p, m, costs)
            print(f"| {p} | {'/'.join(map(str, blocks))} | {m} | {r['auto']:.2f} | "
                  f"{r['fixed_makespan']:.2f} ({r['fixed']}) "
                  f"| {r['auto'] / r['fixed_makespan']:.3f} | {r['auto'] / r['ideal']:.3f} "
                  f"| {r['chosen']} |", flush=True)
    if args.sleep is not None:
        _measure_sleeps(args)
    elif args.measure:
        print(f"\nmeasured (threads, CPU), load {_load()}")
        print("| p | m | auto s | fixed s | measured auto / fixed | simulated | chosen |")
        print("|---|---|---|---|---|---|---|")
        for p in args.ranks:
            blocks = balanced(p, 4 * p, head=args.head, head_w=1.0)
            for m in args.microbatches:
                r = measured(blocks, m, width=args.width, head=int(args.head), rows=4,
                             steps=args.steps)
                print(f"| {p} | {m} | {r['auto_s']:.4f} | {r['fixed_s']:.4f} ({r['fixed']}) | "
                      f"{r['auto_s'] / r['fixed_s']:.3f} | {r['sim_ratio']:.3f} | "
                      f"{r['chosen']} |", flush=True)
    return 0


def _measure_sleeps(args: argparse.Namespace) -> None:
    from benchmarks.auto_sleep import HEADER, measure_cell, row
    from benchmarks.auto_sleep_procs import measure_cell_processes

    cell: Callable[..., dict[str, Any]]
    if args.transport == "processes":
        cell, whose = measure_cell_processes, "the ranks'"
        how = ("comm 0 in the simulation only (one process a rank, gloo on loopback; each "
               "step started together and timed to the last rank's return)")
    else:
        cell, whose = measure_cell, "this process's"
        how = "comm 0 (handed over in memory)"
    print(f"\nmeasured: sleep stages over {args.transport}, {args.sleep:g} ms a block unit, "
          f"{how}; median of {args.steps} steps after a warm-up, one step of each schedule "
          f"per round; load {_load()} at the start")
    print(HEADER)
    cpu = 0.0
    for p in args.ranks:
        blocks = balanced(p, 4 * p, head=args.head, head_w=args.head_w)
        for m in args.microbatches:
            r = cell(blocks, m, head=args.head, head_w=args.head_w, unit=args.sleep / 1000,
                     steps=args.steps)
            cpu += r["cpu_s"]
            print(row(r), flush=True)
    print(f"load {_load()} at the end; {whose} CPU time in the cells: {cpu:.1f} s")


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
