"""Synthetic measurements for the harness's own tests: no processes, no timing."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.config import Group
from benchmarks.harness import Measured, Sample, variant_keys
from benchmarks.planning.rounds import Turn
from benchmarks.planning.space import Config
from benchmarks.records import schedule_for
from pipeline.planner import LayerCosts, ModelProfile
from pipeline.planner.contention import Window
from schedules import Costs, simulate

ENV = {"torch": "2.x", "python": "3.x", "platform": "test", "cpu": "test cpu", "gpu": None,
       "device": "cpu", "backend": "gloo", "num_cpus": 2, "threads_per_rank": 1,
       "plain_all_threads": 2, "git_commit": "abc"}
COSTS = Costs(forward=0.001, backward=0.002, backward_input=0.001, backward_weight=0.001)
# Seconds a step of each kind of variant takes (ours adds OVERHEAD to its simulated makespan).
OVERHEAD = 0.0005
TORCH_FACTOR, PLAIN1, PLAIN_ALL = 1.25, 0.03, 0.02


def group(num_ranks: int = 2, *, model: str = "tiny", microbatches: tuple[int, ...] = (2, 4),
          schedules: tuple[str, ...] = ("gpipe", "1f1b", "zb-h1"),
          transports: tuple[str, ...] = ("processes", "threads")) -> Group:
    balances = {s: ((5,) if num_ranks == 1 else (2, 3)) for s in schedules}
    return Group(model, "params", num_ranks, transports, schedules, microbatches, 1, 3,
                 balances=balances)


def measured(g: Group, m: int, repeats: int = 3, *, cpu_share: float | None = None,
             load: tuple[float | None, float | None] = (None, None),
             window: Window | None = None) -> Measured:
    """Ours takes its simulated makespan (unit costs above) plus OVERHEAD; torch 1.25x that;
    the bound is the busiest rank's work (+1 ms a round); the plain model fixed times. With
    `cpu_share`, each step's processes used that share of its wall time x the threads it
    ran on (the plain model on every thread: ENV's plain_all_threads) as CPU time; `window`
    the rounds' window (what other programs took: pipeline/planner/contention.py)."""
    keys, skipped = variant_keys(g, m)
    samples: dict[str, list[Sample | None]] = {}
    for key in keys:
        _, kind, what = [*key.split("/"), ""][:3]
        rounds: list[Sample | None] = []
        for r in range(repeats):
            start = 10.0 * r
            if kind == "ours":
                tl = simulate(schedule_for(what, g.num_ranks, m), COSTS)
                events = [(e.rank, str(e.action), start + e.start, start + e.end)
                          for e in tl.events]
                rounds.append((start, start + tl.makespan + OVERHEAD * (1 + r), events))
            elif kind == "torch":
                tl = simulate(schedule_for(what, g.num_ranks, m), COSTS)
                rounds.append((start, start + (tl.makespan + OVERHEAD) * TORCH_FACTOR, None))
            elif kind == "bound":
                busy = max(simulate(schedule_for("1f1b", g.num_ranks, m), COSTS).busy(rank)
                           for rank in range(g.num_ranks))
                rounds.append((start, start + busy + 0.001 * r, None))  # fastest: round 0
            else:
                rounds.append((start, start + (PLAIN1 if key == "plain/1" else PLAIN_ALL),
                               None))
        samples[key] = rounds
    memory = {f"{t}/ours/{s}": {"peak_stashed_bytes": [1000 * (r + 1) for r in
                                                       range(g.num_ranks)],
                                "peak_stashed_microbatches": [1] * g.num_ranks}
              for t in g.transports for s in g.schedules}
    memory.update({key: {"peak_stashed_bytes": [1500 * (r + 1) for r in range(g.num_ranks)],
                         "peak_stashed_microbatches": [2] * g.num_ranks}
                   for key in keys if "/torch/" in key})
    cpu: dict[str, list[float | None]] = {}
    if cpu_share is not None:
        for key, rounds in samples.items():
            threads = (1 if key == "plain/1" else ENV["plain_all_threads"]
                       if key == "plain/all" else g.num_ranks)
            cpu[key] = [None if t is None else cpu_share * (t[1] - t[0]) * threads
                        for t in rounds]
    return Measured(samples, memory, skipped, cpu, load, window)


def no_run(*args: object, **kwargs: object) -> None:
    """Stands in for `benchmarks.cli.run_group` where a test must not measure anything."""
    raise AssertionError("measured despite a bad argument")


def planning_profile(layers: int = 5, batch: int = 16,
                     rows: tuple[int, ...] = (1, 2, 4, 8, 16), uniform: bool = False
                     ) -> ModelProfile:
    """A model profile without profiling: layer i's forward takes (i + 1) ms at a full batch
    (1 ms each if `uniform`), scaled by rows (so splits and chunk counts matter), backward
    twice that; 1 KiB of weights and 64 bytes of input and saved tensors per row, per layer."""
    by_rows = {}
    for r in rows:
        share = r / batch
        forward = tuple(0.001 * (1 if uniform else i + 1) * share for i in range(layers))
        by_rows[r] = LayerCosts(r, forward, tuple(2 * f for f in forward), forward, forward,
                                (64.0 * r,) * layers, (64.0 * r,) * layers)
    params = tuple(((i, 1024, True),) for i in range(layers))
    return ModelProfile(layers, params, (0,) * layers, by_rows, batch)


def planning_turn(seconds: Callable[[Config, int], float], calls: list[tuple[str, bool]]
                  ) -> Callable[[Config, bool], Turn]:
    """A turn that takes `seconds(config, its call number)` per step, on one process of two
    pipeline ranks, and records (config key, memory) of each call in `calls`."""
    clock = [0.0]

    def turn(c: Config, memory: bool) -> Turn:
        calls.append((c.key, memory))
        took = seconds(c, sum(1 for k, _ in calls if k == c.key))
        start = clock[0]
        clock[0] += took + 1.0
        events = [[(r, f"{r}F0", start + 0.1 * took * r, start + 0.1 * took * (r + 1))
                   for r in range(c.pp)]]
        return Turn([(start, start + took)], events, list(range(c.pp)), 0,
                    [1000 * (r + 1) for r in range(c.pp)] if memory else [])
    return turn
