"""Synthetic measurements for the harness's own tests: no processes, no timing."""

from __future__ import annotations

from benchmarks.config import Group
from benchmarks.harness import Measured, Sample, variant_keys
from benchmarks.records import schedule_for
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


def measured(g: Group, m: int, repeats: int = 3) -> Measured:
    """Ours takes its simulated makespan (unit costs above) plus OVERHEAD; torch 1.25x that;
    the bound is the busiest rank's work (+1 ms a round); the plain model fixed times."""
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
    return Measured(samples, memory, skipped)


def no_run(*args: object, **kwargs: object) -> None:
    """Stands in for `benchmarks.cli.run_group` where a test must not measure anything."""
    raise AssertionError("measured despite a bad argument")
