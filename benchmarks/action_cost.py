"""`python -m benchmarks.action_cost`: a compute action's host cost beyond the bare layers.

    python -m benchmarks.action_cost --model small --microbatches 8,32 \\
        --schedules interleaved,zb-v --steps 300

One rank holds every stage of the model's balance (`devices=["cpu"]`: a schedule that places
several stages on a rank, such as `interleaved` for F and B or `zb-v` for F, I and W), so the
whole step runs in the calling thread, with no message to wait for and no other thread to
share the core with. Each round takes a Pipe's step and, in turn, the bare equivalent (the
benchmarks' hardware bound, `harness._bound_work`: every stage's forward and backward of every
micro-batch as plain modules and autograd, on inputs prepared beforehand), the order swapped
every round. Per step: the thread's CPU time of each (`time.thread_time`, which a loaded
machine distorts less than wall time), the wall time the Pipe spent inside its compute actions
(the timeline's events) against the bare step's, and under cProfile the function calls of
each. What the Pipe's step costs beyond the bare one, over its compute actions, is the host
cost per action; the part inside the actions is what the stage runtime adds to each.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.harness import _bound_work, _chunks
from pipeline import Pipe
from pipeline.examples.models import balance_for, get_model
from schedules import COMM_OPS

__all__ = ["Config", "Result", "main", "measure"]


@dataclass(frozen=True)
class Config:
    """What to run: model, its balance over `stages` stages, micro-batch counts, schedules."""

    model: str = "small"
    stages: int = 2
    microbatches: tuple[int, ...] = (8, 32)
    schedules: tuple[str, ...] = ("interleaved", "zb-v")
    steps: int = 300
    warmup: int = 30
    profiled: int = 20  # steps of each side under cProfile, after the timed ones


@dataclass(frozen=True)
class Result:
    """One schedule and micro-batch count: medians over the rounds, per step or per action."""

    schedule: str
    num_microbatches: int
    actions: int  # compute actions per step
    step_cpu_ms: float
    bare_cpu_ms: float
    inside_ms: float  # wall time inside the compute actions
    bare_ms: float  # the bare step's wall time
    calls_per_action: float  # the Pipe's function calls per step, over its compute actions
    bare_calls_per_action: float  # the bare step's, over the same count

    @property
    def host_us_per_action(self) -> float:
        return (self.step_cpu_ms - self.bare_cpu_ms) / self.actions * 1e3

    @property
    def inside_us_per_action(self) -> float:
        return (self.inside_ms - self.bare_ms) / self.actions * 1e3


def _calls(fn: Callable[[], object], steps: int) -> float:
    """Function calls (Python and built-in, as cProfile counts them) per call of `fn`."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        fn()
    profile.disable()
    counts = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return float(sum(entry[1] for entry in counts.values())) / steps


def measure(cfg: Config, schedule: str, m: int) -> Result:
    """Alternate the Pipe's step and the bare one; see the module's docstring. Runs on one
    intra-op thread, and gives the caller's thread count back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(cfg, schedule, m)
    finally:
        torch.set_num_threads(threads)


def _measure(cfg: Config, schedule: str, m: int) -> Result:
    spec = get_model(cfg.model)
    model = spec.build()
    x, y = spec.batch()
    loss_fn = spec.loss()
    balance = balance_for(spec, "params", cfg.stages)
    pipe = Pipe(model, balance, chunks=m, schedule=schedule, checkpoint="never",
                devices=["cpu"])
    actions = sum(1 for a in pipe.program(m).actions[0] if a.op not in COMM_OPS)
    bare = _bound_work(model, balance, range(cfg.stages), _chunks(x, y, m), loss_fn,
                       torch.device("cpu"))

    def ours() -> None:
        pipe.step(x, y, loss_fn)

    cpu: dict[str, list[float]] = {"pipe": [], "bare": []}
    wall: dict[str, list[float]] = {"pipe": [], "bare": []}
    gc.collect()
    gc.disable()  # a collection would land on one side only
    try:
        for i in range(cfg.warmup + cfg.steps):
            for what in ("pipe", "bare") if i % 2 == 0 else ("bare", "pipe"):
                model.zero_grad(set_to_none=True)
                used, start = time.thread_time(), time.perf_counter()
                (ours if what == "pipe" else bare)()
                end, used = time.perf_counter(), time.thread_time() - used
                if i < cfg.warmup:
                    continue
                cpu[what].append(used)
                if what == "pipe":
                    events = [e for e in pipe.last_timeline().events
                              if e.action.op not in COMM_OPS]
                    wall[what].append(sum(e.end - e.start for e in events))
                else:
                    wall[what].append(end - start)
            if i % 50 == 49:
                gc.collect()
        calls, bare_calls = _calls(ours, cfg.profiled), _calls(bare, cfg.profiled)
    finally:
        gc.enable()
        pipe.close()
    med = statistics.median
    return Result(schedule, m, actions, med(cpu["pipe"]) * 1e3, med(cpu["bare"]) * 1e3,
                  med(wall["pipe"]) * 1e3, med(wall["bare"]) * 1e3, calls / actions,
                  bare_calls / actions)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.action_cost",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", default="8,32")
    parser.add_argument("--schedules", default="interleaved,zb-v")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--profiled", type=int, default=20)
    args = parser.parse_args(argv)
    cfg = Config(args.model, args.stages, tuple(int(v) for v in args.microbatches.split(",")),
                 tuple(args.schedules.split(",")), args.steps, args.warmup, args.profiled)
    print("| schedule | m | compute actions | step CPU ms | bare CPU ms | host us / action | "
          "inside the actions: us / action | calls / action | bare calls / action | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for schedule in cfg.schedules:
        for m in cfg.microbatches:
            r = measure(cfg, schedule, m)
            print(f"| {schedule} | {m} | {r.actions} | {r.step_cpu_ms:.2f} | "
                  f"{r.bare_cpu_ms:.2f} | {r.host_us_per_action:.1f} | "
                  f"{r.inside_us_per_action:.1f} | {r.calls_per_action:.1f} | "
                  f"{r.bare_calls_per_action:.1f} | {os.getloadavg()[0]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
