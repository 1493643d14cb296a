"""The planning benchmark's measurement: every configuration a turn per round, reshuffled."""

from __future__ import annotations

import gc
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import schedules
from benchmarks.planning.space import Config
from benchmarks.stats import RawEvent, merge_events
from pipeline import Pipe
from pipeline.examples.models import get_model
from pipeline.launch import spawn
from pipeline.planner.time_model import compute_spans
from schedules import Timeline

__all__ = ["Measured", "Turn", "measure", "merge", "orders", "run_rounds", "steps_of"]


@dataclass
class Turn:
    """One configuration's turn in one round, as one process saw it: each timed step's start and
    end (perf_counter, one clock for every process of the host), each timed step's actions on
    this process's pipeline ranks, and (in a memory turn) the peak bytes of each of them."""

    steps: list[tuple[float, float]]
    events: list[list[RawEvent]]
    pp_ranks: list[int]
    dp_rank: int = 0
    peaks: list[int] = field(default_factory=list)
    # Under dp, each timed step's `pipe.data_parallel_stats()`: the seconds this process's
    # gradient all-reduces ran and the seconds the step waited for them after its last action.
    dp_stats: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Measured:
    """One configuration in one round, every process merged: each timed step's seconds (the
    first process's start to the last one's end), each step's timeline (the first replica's
    ranks, counted from the step's first action; `meta["beside"]`, the other replicas'
    compute actions, (start, end) on its clock) and, from the memory round, the peak bytes
    per pipeline rank (the largest over replicas); under dp, each step's all-reduce seconds
    and the seconds the step waited for them (each the largest over processes)."""

    step_s: list[float]
    timelines: list[Timeline]
    peaks: list[int]
    allreduce_s: list[float] = field(default_factory=list)
    exposed_s: list[float] = field(default_factory=list)


def steps_of(measured: Sequence[Sequence[Measured]], i: int) -> list[tuple[float, Timeline]]:
    """Configuration `i`'s timed steps over every round (`measured[round][config]`): each
    step's seconds and timeline."""
    return [(s, tl) for row in measured for s, tl in zip(row[i].step_s, row[i].timelines,
                                                         strict=True)]


def orders(n: int, rounds: int, seed: int) -> list[list[int]]:
    """The order the `n` configurations take their turns in each round: shuffled anew each
    round (the same in every process), so slow drift of the machine falls on all alike."""
    out = []
    for r in range(rounds):
        order = list(range(n))
        random.Random(seed * 100_003 + r).shuffle(order)
        out.append(order)
    return out


def run_rounds(configs: Sequence[Config], turns: Sequence[Sequence[int]],
               turn: Callable[[Config, bool], Turn],
               progress: Callable[[int], None] | None = None) -> list[list[Turn]]:
    """`[round][config]`: each configuration one turn per round, in that round's order; the
    first round's turns also count memory (after their timed steps, so no timing pays it)."""
    out: list[list[Turn]] = []
    for r, order in enumerate(turns):
        if sorted(order) != list(range(len(configs))):
            raise ValueError(f"round {r}'s order is not one turn per configuration: {order}")
        got: dict[int, Turn] = {}
        for i in order:
            got[i] = turn(configs[i], r == 0)
        out.append([got[i] for i in range(len(configs))])
        if progress is not None:
            progress(r)
    return out


def _static(layers: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of these layers' parameters, buffers, gradients and optimizer state."""
    tensors: dict[int, torch.Tensor] = {}
    for layer in layers:
        for t in [*layer.parameters(), *layer.buffers()]:
            tensors[id(t)] = t
        for q in layer.parameters():
            if q.grad is not None:
                tensors[id(q.grad)] = q.grad
            for s in optimizer.state.get(q, {}).values():
                if isinstance(s, torch.Tensor):
                    tensors[id(s)] = s
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _Runner:
    """Takes turns in this process: a fresh model and Pipe per turn, warm-up steps, timed steps
    (a barrier before each, multi-process), and the peaks when asked."""

    def __init__(self, model: str, steps: int, warmup: int, rank: int | None, world: int,
                 dps: Sequence[int]) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.spec = get_model(model)
        (self.x, self.y), self.loss = self.spec.batch(), self.spec.loss()
        self.steps, self.warmup, self.rank = steps, warmup, rank
        # One mesh per shape, made once (collective, the same order everywhere): each turn's
        # Pipe uses it, so no process groups pile up over hundreds of turns.
        self.meshes = {dp: init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "pp"))
                       for dp in sorted(set(dps)) if dp > 1 and rank is not None}

    def __call__(self, c: Config, memory: bool) -> Turn:
        model = self.spec.build()
        kwargs: dict[str, Any] = {"balance": list(c.balance), "chunks": c.chunks,
                                  "schedule": c.schedule, "checkpoint": c.checkpoint}
        x, y, dp_rank = self.x, self.y, 0
        if self.rank is None:
            kwargs["devices"] = ["cpu"] * c.pp
            mine = list(range(c.pp))
        elif c.dp > 1:
            mesh = kwargs["mesh"] = self.meshes[c.dp]
            dp_rank, mine = mesh.get_local_rank("dp"), [mesh.get_local_rank("pp")]
            rows = x.shape[0]
            x, y = (t[rows * dp_rank // c.dp:rows * (dp_rank + 1) // c.dp] for t in (x, y))
        else:
            mine = [self.rank]
        # The last turn's garbage goes now, not inside a timed step; what survives (the
        # results so far) is frozen out of later collections, which stay short (a full one
        # over torch's objects takes ~150 ms here, more than a tiny model's whole turn).
        gc.collect()
        gc.freeze()
        pipe = Pipe(model, **kwargs)
        try:
            for _ in range(self.warmup):  # the schedule is built, buffers are allocated
                model.zero_grad(set_to_none=True)
                pipe.step(x, y, self.loss)
            turn = Turn([], [], mine, dp_rank)
            gc.disable()  # a collection inside one configuration's step charged to it alone
            try:
                for _ in range(self.steps):
                    model.zero_grad(set_to_none=True)
                    if self.rank is not None:
                        dist.barrier()
                    start = time.perf_counter()
                    pipe.step(x, y, self.loss)
                    turn.steps.append((start, time.perf_counter()))
                    timeline = pipe.last_timeline()
                    t0 = float(timeline.meta["t0"])
                    turn.events.append([(e.rank, str(e.action), t0 + e.start, t0 + e.end)
                                        for e in timeline.events])
                    if c.dp > 1:
                        turn.dp_stats.append(pipe.data_parallel_stats())
            finally:
                gc.enable()
            if memory:
                turn.peaks = self._peaks(c, pipe, model, mine, x, y)
        finally:
            pipe.close()
        return turn

    def _peaks(self, c: Config, pipe: Pipe, model: torch.nn.Sequential, mine: list[int],
               x: torch.Tensor, y: torch.Tensor) -> list[int]:
        """Per pipeline rank of this process: its layers' parameters, buffers, gradients and
        Adam's state (after a step with lr 0), plus the stash `track_memory` counted in one
        more step, plus under dp the flat gradient copy the all-reduce holds (counted from
        the parameters: it is freed before the step returns)."""
        model.zero_grad(set_to_none=True)
        pipe.track_memory = True
        pipe.step(x, y, self.loss)
        pipe.track_memory = False
        stash = [s["peak_stashed_bytes"] for s in pipe.memory_stats()]
        optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
        optimizer.step()  # allocates the state Adam keeps
        layers = list(model)
        order = schedules.get_schedule(c.schedule, c.pp, c.chunks, **dict(c.options))
        bounds = [0]
        for b in c.balance:
            bounds.append(bounds[-1] + b)
        peaks = []
        for i, r in enumerate(mine):
            own = [layer for s in order.stages_of(r) for layer in layers[bounds[s]:bounds[s + 1]]]
            flat = sum(q.numel() * q.element_size() for layer in own for q in layer.parameters()
                       if q.requires_grad) if c.dp > 1 else 0
            peaks.append(_static(own, optimizer) + stash[i] + flat)
        return peaks


def merge(per_process: Sequence[Sequence[Sequence[Turn]]], configs: Sequence[Config]
          ) -> list[list[Measured]]:
    """`[round][config]` measurements from every process's turns (`[process][round][config]`)."""
    out: list[list[Measured]] = []
    for r in range(len(per_process[0])):
        row = []
        for i, c in enumerate(configs):
            turns = [p[r][i] for p in per_process]
            steps = len(turns[0].steps)
            step_s = [max(t.steps[k][1] for t in turns) - min(t.steps[k][0] for t in turns)
                      for k in range(steps)]
            first = [t for t in turns if t.dp_rank == 0]
            timelines = []
            for k in range(steps):
                events = [e for t in first for e in t.events[k]]
                start = min((e[2] for e in events), default=0.0)
                # The other replicas' compute on this clock: it slows the first's alike.
                beside = compute_spans((e for t in turns if t.dp_rank != 0
                                        for e in t.events[k]), start)
                timelines.append(merge_events(c.pp, events, start, {"beside": list(beside)}))
            peaks: dict[int, int] = {}
            for t in turns:
                for rank, b in zip(t.pp_ranks, t.peaks, strict=False):
                    peaks[rank] = max(peaks.get(rank, 0), b)
            reduced = [t for t in turns if t.dp_stats]
            row.append(Measured(
                step_s, timelines, [peaks[q] for q in sorted(peaks)],
                [max(t.dp_stats[k]["allreduce_s"] for t in reduced) for k in range(steps)]
                if reduced else [],
                [max(t.dp_stats[k]["exposed_s"] for t in reduced) for k in range(steps)]
                if reduced else []))
        out.append(row)
    return out


def _process(rank: int, model: str, configs: list[Config], turns: list[list[int]], steps: int,
             warmup: int, world: int) -> list[list[Turn]]:
    torch.set_num_threads(1)
    runner = _Runner(model, steps, warmup, rank, world, [c.dp for c in configs])
    return run_rounds(configs, turns, runner, _progress(len(turns)) if rank == 0 else None)


def _progress(rounds: int) -> Callable[[int], None]:
    began = time.perf_counter()

    def done(r: int) -> None:
        print(f"  round {r + 1}/{rounds} done, {time.perf_counter() - began:.0f} s",
              file=sys.stderr, flush=True)
    return done


def measure(model: str, configs: Sequence[Config], *, transport: str, ranks: int,
            turns: Sequence[Sequence[int]], steps: int, warmup: int) -> list[list[Measured]]:
    """Every configuration's turns over the rounds `turns` gives, on threads (one process,
    a thread per rank) or on `ranks` processes (gloo); `[round][config]`."""
    if transport == "threads":
        if any(c.dp > 1 for c in configs):
            raise ValueError("data parallelism runs one process per rank: transport processes")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            runner = _Runner(model, steps, warmup, None, ranks, [1])
            raw = [run_rounds(configs, turns, runner, _progress(len(turns)))]
        finally:
            torch.set_num_threads(threads)
            gc.unfreeze()  # what the turns froze is collectable again
    else:
        raw = spawn(_process, ranks, model, list(configs), [list(o) for o in turns], steps,
                    warmup, ranks, timeout=4 * 3600.0)
    return merge(raw, configs)
