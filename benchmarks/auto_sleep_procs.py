"""The sleep-stage cells of benchmarks/auto_sleep.py with the pipeline's ranks as processes.

Over threads, every rank's host work (the Python between the sleeps) shares one GIL, so a
fuller pipeline's ranks wait for each other's host work. Here the p ranks are p processes
(`pipeline.launch.spawn`: gloo on loopback, the multi-process Pipe, same-host ranks linked by
sockets), each with its own GIL. Every process builds the same sleep model from the same seed
and takes the same steps: each schedule's warm-up step (auto's is its measurement, the costs
exchanged between the ranks as Pipe does), then round after round one step of each label in an
order shuffled by the round's seed, the same on every rank. Each step starts on every process
at once (benchmarks/gate.py's `StartGate`); a step's time runs from the first rank's start to
the last rank's return, as the latency benchmark merges its ranks (benchmarks/measured.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.auto_sleep import (
    REPLAY,
    Plan,
    plan,
    rows_of,
    sleep_model,
    summarise,
    waited,
)
from benchmarks.gate import StartGate, quiet
from pipeline.launch import spawn
from pipeline.replicas.run_queue import RunQueue

__all__ = ["GATE_TIMEOUT", "OrdersDiffer", "measure_cell_processes", "run_rank"]

GATE_TIMEOUT = 600.0  # seconds a rank waits at a step's start for the others


class OrdersDiffer(RuntimeError):
    """The ranks ran auto under different orders: the exchange of its costs went wrong."""


@dataclass(frozen=True)
class _Cell:
    """What every rank needs to build and step a cell (sent to the spawned processes)."""

    plan: Plan
    head: float
    head_w: float
    unit: float
    steps: int
    rows: int
    width: int


def run_rank(rank: int, cell: _Cell, gate: StartGate) -> dict[str, Any]:
    """One rank's part of a cell: per label, each timed step's (start, end) on this host's
    clock and this process's run-queue wait; what auto measured, chose and ran here."""
    from pipeline import Pipe

    try:
        blocks, m = cell.plan.blocks, cell.plan.num_microbatches
        # The same draws in the same order on every rank (and as the threads mode draws).
        torch.manual_seed(0)
        x, y = torch.randn(cell.rows * m, cell.width), torch.randn(cell.rows * m, cell.width)
        loss_fn = nn.MSELoss()
        queue = RunQueue(note=lambda _: None)  # where the kernel keeps no waits: NaN
        pipes: dict[str, Any] = {}
        spans: dict[str, list[tuple[float, float]]] = {}
        queued: dict[str, list[float]] = {}
        cpu = time.process_time()

        def step(label: str) -> tuple[float, float, float]:
            gate.start(True, GATE_TIMEOUT)
            before, start = queue.waits(os.getpid()), time.perf_counter()
            pipes[label].step(x, y, loss_fn)
            end = time.perf_counter()
            wait = waited(before, queue.waits(os.getpid()))
            quiet()  # untimed: this rank's threads settle before the next start
            return start, end, wait

        try:
            for label in cell.plan.labels:
                model, balance = sleep_model(blocks, head=cell.head, head_w=cell.head_w,
                                             unit=cell.unit, width=cell.width)
                order = pipes["auto"].auto.schedule if label == REPLAY else label
                pipes[label] = Pipe(model, balance, chunks=m, schedule=order,
                                    checkpoint="never")
                step(label)  # warm-up (auto: timed, exchanged and synthesised for)
                spans[label], queued[label] = [], []
            labels = list(pipes)
            for r in range(cell.steps):
                random.Random(r).shuffle(labels)  # the same order on every rank
                for label in labels:
                    start, end, wait = step(label)
                    spans[label].append((start, end))
                    queued[label].append(wait)
            auto = pipes["auto"].auto
            assert auto.synthesis is not None  # the warm-up step was measured
            return {"spans": spans, "queued": queued, "costs": auto.costs,
                    "chosen": auto.synthesis.chosen, "schedule": auto.schedule,
                    "cpu_s": time.process_time() - cpu}
        except BaseException:
            gate.abort()  # first: the others wake now, not after this rank's closes
            raise
        finally:
            for pipe in pipes.values():
                pipe.close()
    except BaseException:
        gate.abort()  # wake the others at once instead of at their timeout
        raise


def measure_cell_processes(blocks: Sequence[int], num_microbatches: int, *, head: float,
                           head_w: float, unit: float, steps: int, rows: int = 2,
                           width: int = 8, timeout: float = 3600.0) -> dict[str, Any]:
    """`auto_sleep.measure_cell`'s result with each rank a process: per label, the median
    over rounds of (the last rank's end - the first rank's start); the run-queue waits and
    CPU seconds summed over the ranks; `orders`, the order auto ran on each rank (every rank
    the same, else `OrdersDiffer`). `timeout`: seconds for the whole cell, start-up included
    (`pipeline.launch.RankFailed` names the ranks that failed or hung)."""
    cell = _Cell(plan(blocks, num_microbatches, head=head, head_w=head_w), head, head_w,
                 unit, steps, rows, width)
    p = len(blocks)
    gate = StartGate(mp.get_context("spawn"), p)
    ranks = spawn(run_rank, p, cell, gate, timeout=timeout)
    orders = [rows_of(r["schedule"]) for r in ranks]
    if any(order != orders[0] for order in orders):
        differ = [n for n, order in enumerate(orders) if order != orders[0]]
        raise OrdersDiffer(f"auto must run one order on every rank, but rank(s) {differ} ran "
                           f"another than rank 0 (chosen: {[r['chosen'] for r in ranks]}): "
                           f"the ranks' exchanged costs disagreed")
    times = {label: [max(r["spans"][label][i][1] for r in ranks)
                     - min(r["spans"][label][i][0] for r in ranks) for i in range(steps)]
             for label in cell.plan.labels}
    queued = {label: [sum(r["queued"][label][i] for r in ranks) for i in range(steps)]
              for label in cell.plan.labels}
    first = ranks[0]
    out = summarise(cell.plan, unit, times, queued, measured_costs=first["costs"],
                    chosen=first["chosen"], schedule=first["schedule"],
                    cpu_s=sum(r["cpu_s"] for r in ranks))
    out["orders"] = orders
    return out
