"""`python -m benchmarks.host_cost`: the host CPU time a step spends per action beyond its compute.

    python -m benchmarks.host_cost --model small --microbatches 8,16 --schedule 1f1b \\
        --transport threads,processes --steps 200

Each round takes a Pipe's step and, in turn, the same ranks' compute alone (their stages'
forwards and backwards of every micro-batch on inputs prepared beforehand: the benchmarks'
hardware bound), the order swapped every round, and counts the CPU time (user + system, every
thread of the process) each used. What the step used beyond the compute, over the program's
actions (compute, SEND and RECV of every rank), is the runtime's host cost per action. CPU time
does not count the time a thread waits for a core, so the figure holds on a loaded machine,
where step times do not. Receives do not spin (`PIPELINE_SPIN_US=0`): a spinning wait would
count its idle time as CPU time.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness import _bound_work, _chunks
from pipeline import Pipe
from pipeline.examples.models import balance_for, get_model
from pipeline.launch import spawn

__all__ = ["Config", "main", "measure", "run_ranks"]


@dataclass(frozen=True)
class Config:
    """What to run: model, micro-batch counts, schedule, transports, rounds."""

    model: str = "small"
    ranks: int = 2
    microbatches: tuple[int, ...] = (8, 16)
    schedule: str = "1f1b"
    transports: tuple[str, ...] = ("threads", "processes")
    steps: int = 200
    warmup: int = 20


def run_ranks(rank: int | None, cfg: Config, m: int) -> tuple[int, list[float], list[float]]:
    """This process's rounds: the program's actions on its ranks, and per round the CPU
    seconds of the step and of its ranks' compute alone (rank None: every rank here)."""
    torch.set_num_threads(1)
    spec = get_model(cfg.model)
    model = spec.build()
    x, y = spec.batch()
    loss_fn = spec.loss()
    balance = balance_for(spec, "params", cfg.ranks)
    pipe = Pipe(model, balance, chunks=m, schedule=cfg.schedule, checkpoint="never",
                devices=["cpu"] * cfg.ranks if rank is None else None)
    program = pipe.program(m)
    mine = range(cfg.ranks) if rank is None else [rank]
    actions = sum(len(program.actions[r]) for r in mine)
    works = [_bound_work(model, balance, program.stages_of(r), _chunks(x, y, m), loss_fn,
                         torch.device("cpu")) for r in mine]
    steps: list[float] = []
    alone: list[float] = []
    gc.collect()
    gc.disable()  # a collection would land on one side only
    try:
        for i in range(cfg.warmup + cfg.steps):
            for what in ("pipe", "alone") if i % 2 == 0 else ("alone", "pipe"):
                model.zero_grad(set_to_none=True)
                start = time.process_time()
                if what == "pipe":
                    pipe.step(x, y, loss_fn)
                else:
                    for work in works:
                        work()
                used = time.process_time() - start
                if i >= cfg.warmup:
                    (steps if what == "pipe" else alone).append(used)
            if i % 50 == 49:
                gc.collect()
    finally:
        gc.enable()
        pipe.close()
    return actions, steps, alone


def measure(cfg: Config, transport: str, m: int) -> dict[str, float]:
    """CPU milliseconds per step (median over the rounds, summed over the processes): the
    step's, the compute alone's, and the host microseconds per action between them."""
    if transport == "threads":
        per_process = [run_ranks(None, cfg, m)]
    else:
        os.environ["PIPELINE_SPIN_US"] = "0"  # read by the ranks' transports
        try:
            per_process = spawn(run_ranks, cfg.ranks, cfg, m, timeout=3600.0)
        finally:
            del os.environ["PIPELINE_SPIN_US"]
    actions = sum(p[0] for p in per_process)
    step = sum(statistics.median(p[1]) for p in per_process)
    alone = sum(statistics.median(p[2]) for p in per_process)
    return {"actions": actions, "step_ms": step * 1e3, "alone_ms": alone * 1e3,
            "host_us_per_action": (step - alone) / actions * 1e6}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_cost",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="small")
    parser.add_argument("--microbatches", default="8,16")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--transport", default="threads,processes")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    cfg = Config(args.model, 2, tuple(int(v) for v in args.microbatches.split(",")),
                 args.schedule, tuple(args.transport.split(",")), args.steps, args.warmup)
    print("| transport | m | actions | step CPU ms | compute alone CPU ms | host us / action |")
    print("|---|---|---|---|---|---|")
    for transport in cfg.transports:
        for m in cfg.microbatches:
            r: dict[str, Any] = measure(cfg, transport, m)
            print(f"| {transport} | {m} | {r['actions']} | {r['step_ms']:.2f} | "
                  f"{r['alone_ms']:.2f} | {r['host_us_per_action']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
