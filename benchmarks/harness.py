"""The measurement: every variant of a group takes one step in turn, round after round, on one
set of processes, so whatever else the machine does falls on all of them alike.

A group (one model, partition method and rank count) spawns, once:

    ranks 0..p-1   the multi-process pipeline (gloo, or NCCL on GPUs): ours and torch's peer
    rank p         the plain model on 1 thread
    rank p+1       the plain model on all threads
    rank p+2       the threads pipeline: one process, a thread per rank (it leaves the gloo
                   world, so Pipe runs its in-process transport)

Each process keeps its thread count for its whole life (switching torch's thread count
between steps costs more than a step here). For each micro-batch count m, the variants are:
ours under each schedule and torch's peer of each (processes), ours again (threads), the
hardware bound of each partition in each transport (every rank's stages computing at once on
inputs prepared beforehand, sending nothing), and the plain model with gradient accumulation
over the same m micro-batches. A barrier starts each step, and the processes that take it start
together once every process is through (benchmarks/gate.py).
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.config import Group, stages_per_rank
from benchmarks.gate import StartGate, quiet
from benchmarks.measured import Measured, Sample, merge_ranks
from benchmarks.stats import RawEvent
from benchmarks.torch_baseline import TorchPipeline, unsupported
from pipeline import Pipe
from pipeline.comm import same_host
from pipeline.examples.models import balance_for, get_model
from pipeline.planner import contention
from pipeline.runtime.microbatch import scatter

__all__ = ["Measured", "Sample", "Variant", "alternate", "bound_key", "merge_ranks",
           "resolve_balances", "roles", "run_rank", "variant_keys"]

LossFn = Callable[[Any, Any], torch.Tensor]
_TIMEOUT = 600.0  # seconds a process waits at the barrier for the others
_log = logging.getLogger(__name__)


@dataclass
class Variant:
    """One way to take a training step; `step` None means this process sits it out."""

    key: str
    step: Callable[[], object] | None
    collect: Callable[[float], list[RawEvent]] | None = None  # after a step: its events


@cache
def _balance(model: str, method: str, num_stages: int) -> tuple[int, ...]:
    return tuple(balance_for(get_model(model), method, num_stages))


def resolve_balances(group: Group) -> Group:
    """The group with a balance per schedule, computed once in this process and reused by
    every group (profiled balances vary from run to run)."""
    balances = {s: _balance(group.model, group.balance_method,
                            group.num_ranks * stages_per_rank(s)) for s in group.schedules}
    _log.info("group %s: balance by %s: %s", group.name, group.balance_method,
              {s: list(b) for s, b in balances.items()})
    return replace(group, balances=balances)


def roles(group: Group) -> list[str]:
    """What each spawned process does: "pipe" (one rank of the multi-process pipeline),
    "plain:1", "plain:all", "threads"."""
    out = ["pipe"] * group.num_ranks if "processes" in group.transports else []
    out += ["plain:1", "plain:all"]
    return out + (["threads"] if "threads" in group.transports else [])


def bound_key(transport: str, balance: Sequence[int]) -> str:
    return f"{transport}/bound/" + "-".join(map(str, balance))


def variant_keys(group: Group, m: int) -> tuple[list[str], dict[str, str]]:
    """Every variant of micro-batch count m in a fixed order, and those skipped (and why)."""
    keys: list[str] = []
    skipped: dict[str, str] = {}
    for transport in ("processes", "threads"):
        if transport not in group.transports:
            continue
        for s in group.schedules:
            keys.append(f"{transport}/ours/{s}")
            reason = (unsupported(s, group.num_ranks, m) if transport == "processes" else
                      "torch.distributed.pipelining runs one process per rank only")
            if reason is None:
                keys.append(f"{transport}/torch/{s}")
            else:
                skipped[f"{transport}/torch/{s}"] = reason
        keys += [bound_key(transport, b) for b in sorted(set(group.balances.values()))]
    return [*keys, "plain/1", "plain/all"], skipped


def alternate(variants: Sequence[Variant], *, warmup: int, repeats: int,
              prepare: Callable[[], None], barrier: Callable[[bool], None],
              sync: Callable[[], None], settle: Callable[[], object] = quiet,
              cpu: dict[str, list[float | None]] | None = None
              ) -> dict[str, list[Sample | None]]:
    """Round after round, each variant one step (the order rotates every round); after
    `warmup` rounds, record each step's start and end and what `collect` returns.
    `barrier(taking)` precedes every step on every process (`taking`: whether this process
    takes it; see gate.StartGate.start), and `settle()` follows each step this process took
    (untimed: see gate.quiet). `cpu`, if given, gets the CPU seconds this process used in
    each recorded step (None where it sat out), to tell a contended step (contention.py)."""
    out: dict[str, list[Sample | None]] = {v.key: [] for v in variants}
    if cpu is not None:
        cpu.update({v.key: [] for v in variants})
    gc.collect()
    gc.disable()  # a collection inside one variant's step would be charged to it alone
    try:
        for r in range(warmup + repeats):
            for i in range(len(variants)):
                v = variants[(i + r) % len(variants)]
                if v.step is not None:
                    prepare()
                barrier(v.step is not None)
                used = contention.cpu_seconds()
                start = time.perf_counter()
                if v.step is not None:
                    v.step()
                    sync()
                end = time.perf_counter()
                used = contention.cpu_seconds() - used
                if v.step is not None:
                    settle()
                if r >= warmup:
                    if cpu is not None:
                        cpu[v.key].append(None if v.step is None else used)
                    if v.step is None:
                        out[v.key].append(None)
                    else:
                        events = v.collect(start) if v.collect is not None else None
                        out[v.key].append((start, end, events))
            gc.collect()
    finally:
        gc.enable()
    return out


def _chunks(x: Any, y: Any, m: int) -> list[tuple[Any, Any, float]]:
    xs, ys = scatter(x, m), scatter(y, m)
    rows = [int(part[0].shape[0]) for part in ys]
    return [(a[0], b[0], n / sum(rows)) for a, b, n in zip(xs, ys, rows, strict=True)]


def _plain(model: nn.Module, chunks: list[tuple[Any, Any, float]], loss_fn: LossFn
           ) -> Callable[[], object]:
    def step() -> None:
        for x, y, w in chunks:
            torch.autograd.backward(loss_fn(model(x), y) * w)
    return step


def _bound_work(model: nn.Sequential, balance: Sequence[int], stages: Sequence[int],
                chunks: list[tuple[Any, Any, float]], loss_fn: LossFn,
                device: torch.device) -> Callable[[], None]:
    """One rank's share of the hardware bound: its stages' forward and backward of every
    micro-batch, on inputs computed beforehand, sending nothing."""
    layers = list(model)
    bounds = [0]
    for size in balance:
        bounds.append(bounds[-1] + size)
    parts = [nn.Sequential(*layers[bounds[s]:bounds[s + 1]]) for s in range(len(balance))]
    last = len(balance) - 1
    work: list[tuple[int, Any, Any, Any, float]] = []  # stage, input, grad, target, weight
    with torch.no_grad():
        for x, y, w in chunks:
            value = x
            for s, part in enumerate(parts):
                # With threads on GPUs each stage's layers sit on their rank's device.
                value = value.to(next((p.device for p in part.parameters()), device))
                out = part(value)
                if s in stages:
                    work.append((s, value, None if s == last else torch.ones_like(out),
                                 y.to(device), w))
                value = out

    def step() -> None:
        for s, value, grad, y, w in work:
            # A received activation is a leaf that requires grad, as in the pipeline; the
            # first stage's input is data.
            inp = value.detach().requires_grad_() if s and value.is_floating_point() else value
            out = parts[s](inp)
            if grad is None:
                torch.autograd.backward(loss_fn(out, y) * w)
            else:
                torch.autograd.backward(out, grad)
    return step


def _concurrently(works: Sequence[Callable[[], None]]) -> Callable[[], object]:
    if len(works) == 1:
        return works[0]

    def step() -> None:
        threads = [threading.Thread(target=w) for w in works]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return step


def _events(pipe: Pipe, rank: int | None) -> Callable[[float], list[RawEvent]]:
    # The timeline's times count from the step's start inside Pipe (its meta's "t0", on the
    # same clock in every process of a host), after the call's own checks: events of two
    # processes are placed on one time axis by it, not by each call's start.
    def collect(start: float) -> list[RawEvent]:
        timeline = pipe.last_timeline()
        t0 = float(timeline.meta.get("t0", start))
        return [(e.rank if rank is None else rank, str(e.action), t0 + e.start,
                 t0 + e.end) for e in timeline.events]
    return collect


def _memory(pipes: dict[str, Pipe], step: Callable[[Pipe], object],
            prepare: Callable[[], None]) -> dict[str, dict[str, list[int]]]:
    """Per pipe and rank (this process's ranks), the peak stashed bytes and micro-batches of
    one more step, counting what autograd saved too (not timed: the counting costs)."""
    out = {}
    for name, pipe in pipes.items():
        pipe.track_memory = True
        prepare()
        step(pipe)
        pipe.track_memory = False
        stats = pipe.memory_stats()
        out[name] = {"peak_stashed_bytes": [s["peak_stashed_bytes"] for s in stats],
                     "peak_stashed_microbatches": [s["peak_stashed_microbatches"]
                                                   for s in stats],
                     "peak_activation_bytes": [s.get("peak_activation_bytes", 0) for s in stats]}
    return out


class _Process:
    """This process's part of a group: its model copy, data and the steps it can take."""

    def __init__(self, rank: int, group: Group) -> None:
        self.group = group
        self.role = roles(group)[rank]
        p = group.num_ranks
        self.rank = rank if self.role == "pipe" else 0
        cuda = group.device == "cuda"
        # More ranks than GPUs happens with threads only (config.fit_to_gpus): they share.
        self.devices = [torch.device("cuda", r % torch.cuda.device_count()) if cuda
                        else torch.device("cpu") for r in range(p)]
        self.device = self.devices[self.rank]
        torch.set_num_threads((os.cpu_count() or 1) if self.role == "plain:all" else 1)
        if self.role == "pipe" and same_host.SPIN_ENV not in os.environ:
            # The plain processes wait at the barrier while a pipeline steps: the pipeline
            # ranks spin (or not) as a job of only them on this host would, not as one of
            # every process spawned here (see same_host.spin_time).
            spin = same_host.spin_time(p, None)
            os.environ[same_host.SPIN_ENV] = f"{spin * 1e6:g}"
        if cuda and self.role == "pipe":
            torch.cuda.set_device(self.device)
        spec = get_model(group.model)
        self.model = spec.build()
        if self.role != "threads":  # the threads pipeline places each stage itself
            self.model.to(self.device)
        x, y = spec.batch()
        self.x, self.y = x.to(self.device), y.to(self.device)
        self.loss_fn = spec.loss()
        self._copies: dict[tuple[int, ...], nn.Sequential] = {}
        backend = "nccl" if cuda else None
        # Ours and torch's talk over groups of their own: neither can take the other's
        # messages. Creating a group is collective: every process takes part.
        pipe_ranks = list(range(p)) if "processes" in group.transports else [0]
        self.ours_group = dist.new_group(pipe_ranks, backend=backend)
        self.torch_group = dist.new_group(pipe_ranks, backend=backend)
        if self.role == "threads":
            # Pipe would see the process group and run as one rank of it: leave it.
            dist.destroy_process_group()
            os.environ["WORLD_SIZE"] = "1"

    def _model_for(self, balance: Sequence[int]) -> nn.Sequential:
        """The model, or on GPUs with threads a copy per partition (Pipe moves each stage's
        layers to its rank's device, and another partition would move them again)."""
        if self.role != "threads" or self.device.type != "cuda":
            return self.model
        key = tuple(balance)
        if key not in self._copies:
            self._copies[key] = copy.deepcopy(self.model)
        return self._copies[key]

    def sync(self) -> None:
        if self.device.type == "cuda":
            for d in (self.devices if self.role == "threads" else [self.device]):
                torch.cuda.synchronize(d)

    def prepare(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for model in self._copies.values():
            model.zero_grad(set_to_none=True)

    def variants(self, m: int
                 ) -> tuple[list[Variant], dict[str, Pipe], dict[str, TorchPipeline]]:
        """This process's variants for m micro-batches, and its pipelines (ours and torch's
        peers, by variant key) for the memory step."""
        keys, _ = variant_keys(self.group, m)
        steps: dict[str, Callable[[], object]] = {}
        collect: dict[str, Callable[[float], list[RawEvent]]] = {}
        pipes: dict[str, Pipe] = {}
        peers: dict[str, TorchPipeline] = {}
        x, y, loss_fn, g = self.x, self.y, self.loss_fn, self.group
        chunks = _chunks(x, y, m)
        if self.role in ("plain:1", "plain:all"):
            steps[self.role.replace(":", "/")] = _plain(self.model, chunks, loss_fn)
        transport = {"pipe": "processes", "threads": "threads"}.get(self.role)
        if transport is not None:
            for s in g.schedules:
                key = f"{transport}/ours/{s}"
                pipe = Pipe(self._model_for(g.balances[s]), list(g.balances[s]), chunks=m,
                            schedule=s,
                            checkpoint="never", devices=[str(d) for d in self.devices],
                            group=self.ours_group if transport == "processes" else None)
                pipes[key] = pipe
                steps[key] = _ours(pipe, x, y, loss_fn)
                collect[key] = _events(pipe, self.rank if transport == "processes" else None)
                if f"processes/torch/{s}" in keys and transport == "processes":
                    peer = TorchPipeline(self.model, g.balances[s], schedule=s, rank=self.rank,
                                         num_ranks=g.num_ranks, num_microbatches=m,
                                         loss_fn=loss_fn, device=self.device,
                                         group=self.torch_group)
                    peers[f"processes/torch/{s}"] = peer
                    steps[f"processes/torch/{s}"] = _peer(peer, x, y)
            for balance in sorted(set(g.balances.values())):
                ranks = [self.rank] if transport == "processes" else list(range(g.num_ranks))
                model = self._model_for(balance)
                works = [_bound_work(model, balance, range(r, len(balance), g.num_ranks), chunks,
                                     loss_fn, self.devices[r]) for r in ranks]
                steps[bound_key(transport, balance)] = _concurrently(works)
        return [Variant(k, steps.get(k), collect.get(k)) for k in keys], pipes, peers


def _ours(pipe: Pipe, x: Any, y: Any, loss_fn: LossFn) -> Callable[[], object]:
    return lambda: pipe.step(x, y, loss_fn)


def _peer(peer: TorchPipeline, x: Any, y: Any) -> Callable[[], object]:
    return lambda: peer.step(x, y)


def run_rank(rank: int, group: Group, gate: StartGate, progress: Any = None
             ) -> dict[int, Measured]:
    """Body of each spawned process (see the module's docstring for who does what)."""
    try:
        me = _Process(rank, group)
        results: dict[int, Measured] = {}
        for m in group.microbatches:
            variants, pipes, peers = me.variants(m)
            cpu: dict[str, list[float | None]] = {}
            # Each process counts its own CPU time from before a barrier to before another;
            # the machine is read after each, when every process is through: the machine's
            # window holds every process's (they sleep in the barrier in between). The parent
            # only waits on a queue meanwhile: its CPU time is left out.
            ours = contention.cpu_seconds(children=True)
            gate.wait(_TIMEOUT)
            machine, wall = contention.machine_busy(), contention.wall_clock()
            samples = alternate(variants, warmup=group.warmup, repeats=group.repeats,
                                prepare=me.prepare,
                                barrier=lambda taking: gate.start(taking, _TIMEOUT),
                                sync=me.sync, cpu=cpu)
            ours = contention.cpu_seconds(children=True) - ours
            gate.wait(_TIMEOUT)
            after, wall = contention.machine_busy(), contention.wall_clock() - wall
            window = contention.Window(wall, ours, None if machine is None or after is None
                                       else after - machine)
            memory = _memory(pipes, lambda pipe: pipe.step(me.x, me.y, me.loss_fn), me.prepare)
            for key, peer in peers.items():  # the same keys, in the same order, on every rank
                me.prepare()
                memory[key] = peer.memory_step(me.x, me.y)
            results[m] = Measured(samples, memory, variant_keys(group, m)[1], cpu,
                                  window=window)
            gate.wait(_TIMEOUT)  # the pipelines' memory steps are done everywhere
            if progress is not None and rank == 0:
                progress.put(m)
        return results
    except BaseException:
        gate.abort()  # wake the others at once instead of at their timeout
        raise
