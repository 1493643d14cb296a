"""Stages whose forward, input-gradient and weight-gradient each sleep a set time: `auto` timed.

A block combines its input x with a weight w (tanh(x * w)); x passes through a function whose
forward sleeps F and whose backward sleeps I, w through one whose backward sleeps W. The split
backward (pipeline/runtime/split_backward.py) reaches x's branch in the I pass and w's in the
W pass, so the sleeps land in the actions that a schedule's I and W name (on the first stage,
whose input needs no gradient, W runs both branches). A sleep holds neither
the GIL nor a core: p ranks' threads overlap on a machine with fewer cores, and a step takes the
schedule's makespan in sleep units plus the runtime's host time. That makes the ratio between
two schedules' measured steps meaningful where real matmuls would fight for the cores.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.replicas.run_queue import RunQueue, Waits
from schedules import Costs, Op, Schedule
from schedules.auto import Synthesis, search
from schedules.simulate import makespan

__all__ = ["HEADER", "REPLAY", "Plan", "SleepBlock", "measure_cell", "plan", "row", "rows_of",
           "runtime_costs", "sleep_model", "summarise", "waited"]

_COMPUTE = (Op.F, Op.I, Op.W)
REPLAY = "auto's order"  # the control: the order auto chose, given to a Pipe as a Schedule
Log = Callable[[str, str], None]  # (the block's label, "F", "I" or "W"): called at each sleep


class _Sleep(torch.autograd.Function):
    """The identity; its forward sleeps `forward_s`, its backward `backward_s` (named `kind`,
    "I" or "W", to `note`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float, kind: str,
                note: Callable[[str], None]) -> torch.Tensor:
        ctx.backward_s, ctx.kind, ctx.note = backward_s, kind, note
        if forward_s > 0:
            note("F")
            time.sleep(forward_s)
        return x.clone()  # a Function's output must be a new tensor (or a marked view)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.backward_s > 0:
            ctx.note(ctx.kind)
            time.sleep(ctx.backward_s)
        return grads[0], None, None, None, None


class SleepBlock(nn.Module):
    """tanh(x * w), w a `width` vector; sleeps `forward_s` in the forward, `input_s` in x's
    gradient and `weight_s` in w's (seconds)."""

    def __init__(self, width: int, *, forward_s: float, input_s: float, weight_s: float,
                 label: str = "", log: Log | None = None) -> None:
        super().__init__()
        if min(forward_s, input_s, weight_s) < 0:
            raise ValueError(f"a SleepBlock's sleeps must be >= 0 seconds (got F {forward_s}, "
                             f"I {input_s}, W {weight_s}): pass non-negative costs")
        # Near 1, so that a stack of blocks neither vanishes nor saturates.
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s
        self.label, self.log = label, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xi = _Sleep.apply(x, self.forward_s, self.input_s, "I",  # type: ignore[no-untyped-call]
                          self._note)
        ww = _Sleep.apply(self.weight, 0.0, self.weight_s, "W",  # type: ignore[no-untyped-call]
                          self._note)
        out: torch.Tensor = torch.tanh(xi * ww)
        return out

    def _note(self, kind: str) -> None:
        if self.log is not None:
            self.log(self.label, kind)


def sleep_model(blocks: Sequence[int], *, head: float, head_w: float, unit: float,
                width: int = 8, log: Log | None = None) -> tuple[nn.Sequential, list[int]]:
    """The unequal-stage model of benchmarks/auto_schedule.py's `stage_costs` in sleeps of
    `unit` seconds a block unit, and its balance: an embedding (F 0.5, I 0, W 0.5) first,
    `blocks[s]` blocks (1 each) on stage s, a head (F = I = `head`, W = `head * head_w`)."""
    if unit <= 0 or not blocks or min(blocks) < 0:
        raise ValueError(f"sleep_model needs unit > 0 seconds and blocks >= 0 per stage (got "
                         f"unit {unit}, blocks {list(blocks)}): e.g. unit=0.003, blocks=[6, 2]")
    layers = [SleepBlock(width, forward_s=0.5 * unit, input_s=0.0, weight_s=0.5 * unit,
                         label="embedding", log=log)]
    layers += [SleepBlock(width, forward_s=unit, input_s=unit, weight_s=unit,
                          label=f"block{n}", log=log) for n in range(sum(blocks))]
    layers.append(SleepBlock(width, forward_s=head * unit, input_s=head * unit,
                             weight_s=head * head_w * unit, label="head", log=log))
    balance = list(blocks)
    balance[0] += 1
    balance[-1] += 1
    return nn.Sequential(*layers), balance


def runtime_costs(costs: Costs, num_stages: int) -> Costs:
    """`costs` as the runtime runs them in one process: the first stage's input needs no
    gradient, so its I computes nothing and its W the whole backward (split_backward's
    fallback); transfers are handed over in memory (comm 0)."""
    f, i, w = ([costs.of(op, s) for s in range(num_stages)] for op in _COMPUTE)
    w[0], i[0] = w[0] + i[0], 0.0
    return Costs(forward=f, backward_input=i, backward_weight=w,
                 backward=[a + b for a, b in zip(i, w, strict=True)], comm=0.0)


def _ideal(costs: Costs, num_ranks: int, num_microbatches: int) -> float:
    return max(num_microbatches * sum(costs.of(op, r) for op in _COMPUTE)
               for r in range(num_ranks))


@dataclass(frozen=True)
class Plan:
    """A cell's simulation: the costs the runtime runs (`runtime_costs`, sleep units), auto's
    synthesis for them, and the fixed schedules within 1F1B's memory, in the search's order."""

    blocks: tuple[int, ...]
    num_microbatches: int
    nominal: Costs
    planned: Synthesis
    fixed: tuple[str, ...]

    @property
    def labels(self) -> list[str]:
        """What each round times: auto, its order replayed (`REPLAY`), every fixed schedule."""
        return ["auto", REPLAY, *self.fixed]


def plan(blocks: Sequence[int], num_microbatches: int, *, head: float, head_w: float) -> Plan:
    """The simulated side of a cell (the same whichever transport measures it)."""
    from benchmarks.auto_schedule import stage_costs

    p, m = len(blocks), num_microbatches
    nominal = runtime_costs(stage_costs(blocks, head=head, head_w=head_w, comm=0.0), p)
    planned = search(p, m, nominal, memory_limit=p)
    fixed = tuple(name for name, _ in planned.candidates if name in planned.fixed)
    return Plan(tuple(blocks), m, nominal, planned, fixed)


def measure_cell(blocks: Sequence[int], num_microbatches: int, *, head: float, head_w: float,
                 unit: float, steps: int, rows: int = 2, width: int = 8) -> dict[str, Any]:
    """Median step seconds, over threads, of `auto` and of every fixed schedule within 1F1B's
    memory, one step of each per round (in an order shuffled every round, so drift hits all
    alike), after a warm-up step each (auto's first step is its measurement). A control runs
    the order auto chose as a given schedule (`REPLAY`): auto against its own order is the
    noise floor of the ratios. Beside them the
    simulated makespans (sleep units) of the costs the runtime runs (`runtime_costs`), and
    the seconds this process's threads waited on a CPU's run queue per step (the load's toll:
    a sleep that ends waits there for a core)."""
    from pipeline import Pipe

    cell = plan(blocks, num_microbatches, head=head, head_w=head_w)
    p, m = len(blocks), num_microbatches
    torch.manual_seed(0)
    x, y = torch.randn(rows * m, width), torch.randn(rows * m, width)
    loss_fn = nn.MSELoss()
    pipes: dict[str, Any] = {}
    times: dict[str, list[float]] = {}
    queued: dict[str, list[float]] = {}
    queue = RunQueue(note=lambda _: None)  # where the kernel keeps no waits: reported as NaN
    cpu = time.process_time()
    try:
        for label in cell.labels:
            model, balance = sleep_model(blocks, head=head, head_w=head_w, unit=unit,
                                         width=width)
            order = pipes["auto"].auto.schedule if label == REPLAY else label
            pipe = pipes[label] = Pipe(model, balance, devices=["cpu"] * p, chunks=m,
                                       schedule=order, checkpoint="never")
            pipe.step(x, y, loss_fn)  # warm-up (auto: timed, and synthesised for)
            times[label], queued[label] = [], []
        labels = list(pipes)
        for r in range(steps):
            random.Random(r).shuffle(labels)  # no schedule always follows the same one
            for label in labels:
                before, start = queue.waits(os.getpid()), time.perf_counter()
                pipes[label].step(x, y, loss_fn)
                times[label].append(time.perf_counter() - start)
                queued[label].append(waited(before, queue.waits(os.getpid())))
        auto = pipes["auto"].auto
        measured_costs, chosen, schedule = auto.costs, auto.synthesis.chosen, auto.schedule
    finally:
        for pipe in pipes.values():
            pipe.close()
    return summarise(cell, unit, times, queued, measured_costs=measured_costs, chosen=chosen,
                     schedule=schedule, cpu_s=time.process_time() - cpu)


def summarise(cell: Plan, unit: float, times: dict[str, list[float]],
              queued: dict[str, list[float]], *, measured_costs: Costs | None, chosen: str,
              schedule: Schedule, cpu_s: float) -> dict[str, Any]:
    """A cell's result (what `row` prints) from each label's step seconds and run-queue
    waits per timed round, and what auto measured, chose and ran (`schedule`)."""
    p, m, fixed = len(cell.blocks), cell.num_microbatches, cell.fixed
    makespans = dict(cell.planned.candidates)
    median = {label: statistics.median(t) for label, t in times.items()}
    best = min(fixed, key=lambda name: (median[name], fixed.index(name)))
    sim_best = min(fixed, key=lambda name: (makespans[name], fixed.index(name)))
    ideal = _ideal(cell.nominal, p, m)
    return {"p": p, "m": m, "unit": unit, "median_s": median, "best_fixed": best,
            "auto_s": median["auto"], "fixed_s": median[best], "ideal_s": ideal * unit,
            "sim_auto": cell.planned.makespan, "sim_fixed": makespans[sim_best],
            "sim_best_fixed": sim_best, "sim_ideal": ideal,
            # Each label's simulated makespan (sleep units) for the sleeps: auto and its
            # replay run the order auto chose from what it measured.
            "sim_makespans": {label: makespans[label] if label in fixed
                              else makespan(schedule, cell.nominal) for label in times},
            "chosen": chosen, "planned": cell.planned.chosen,
            "same_order": rows_of(schedule) == rows_of(cell.planned.schedule),
            "queued_s": {label: statistics.median(q) for label, q in queued.items()},
            "measured_costs": measured_costs,
            "profile": _profile(measured_costs, cell.nominal, unit, p), "cpu_s": cpu_s}


def waited(before: Waits | None, after: Waits | None) -> float:
    """Seconds the threads alive at both reads waited on a run queue between them, summed."""
    if before is None or after is None:
        return float("nan")
    return sum(max(t.waited - before[tid].waited, 0) for tid, t in after.items()
               if tid in before) / 1e9


def _profile(measured: Costs | None, nominal: Costs, unit: float, num_stages: int) -> float:
    """The F, I and W auto measured, summed over stages, over the sleeps' (1: exactly)."""
    if measured is None:
        return float("nan")
    return (sum(measured.of(op, s) for op in _COMPUTE for s in range(num_stages))
            / sum(unit * nominal.of(op, s) for op in _COMPUTE for s in range(num_stages)))


def rows_of(schedule: Schedule) -> tuple[tuple[str, ...], ...]:
    """A schedule's compute actions per rank, as text (comparable, and sent between processes)."""
    return tuple(tuple(map(str, row)) for row in schedule.actions)


HEADER = ("| p | m | auto ms | best fixed ms | auto / best fixed | auto / ideal | simulated: "
          "auto / best fixed | auto / ideal | chosen (for the sleeps) | profile / sleeps | "
          "auto / its order replayed | queued ms (auto, best fixed) | every fixed ms | "
          "measured / simulated |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(r: dict[str, Any]) -> str:
    """One cell of the measured table (`HEADER`), from `measure_cell`'s result."""
    ms = {k: 1000 * v for k, v in r["median_s"].items()}
    # The order auto ran against the one the search finds for the sleeps: a greedy policy of
    # the same name orders differently for other costs.
    planned = ("" if r["same_order"] else " (another order for the sleeps)"
               if r["planned"] == r["chosen"] else f" (sleeps: {r['planned']})")
    q = {k: 1000 * v for k, v in r["queued_s"].items()}
    every = ", ".join(f"{k} {v:.1f}" for k, v in ms.items() if k not in ("auto", REPLAY))
    # Each schedule's step over its simulated makespan: what the runtime adds to the sleeps.
    over = ", ".join(f"{k} {r['median_s'][k] / (r['sim_makespans'][k] * r['unit']):.3f}"
                     for k in ms if k != REPLAY)
    return (f"| {r['p']} | {r['m']} | {ms['auto']:.1f} | {ms[r['best_fixed']]:.1f} "
            f"({r['best_fixed']}) | {r['auto_s'] / r['fixed_s']:.3f} | "
            f"{r['auto_s'] / r['ideal_s']:.3f} | {r['sim_auto'] / r['sim_fixed']:.3f} "
            f"({r['sim_best_fixed']}) | {r['sim_auto'] / r['sim_ideal']:.3f} | "
            f"{r['chosen']}{planned} | {r['profile']:.3f} | "
            f"{r['auto_s'] / r['median_s'][REPLAY]:.3f} | {q['auto']:.1f}, "
            f"{q[r['best_fixed']]:.1f} | {every} | {over} |")
