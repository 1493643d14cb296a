"""The planner's choice against the default configuration and against exhaustive measurement.

    python -m benchmarks.planning --out benchmarks/results/planning

For each model and transport (p = 2): profile the model once (one thread), measure the link,
take the default configuration (`1f1b`, `balance="params"`, `chunks=p`,
`checkpoint="except_last"`) and use its predicted peak as the memory budget; plan within it;
then measure every configuration of the planner's space (each schedule, checkpoint mode and
chunk count, with the split the planner gives it) that is predicted to fit: a screening pass
of a few steps each, then a final pass where the plan, the default and the screen's three
fastest take their steps in turn, round after round. The exhaustive best is the fastest
configuration of the final pass whose measured peak is within the budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import schedules
from benchmarks.env import environment
from benchmarks.models import get_model
from pipeline import Pipe
from pipeline.launch import spawn
from pipeline.planner import (
    Candidate,
    Link,
    ModelProfile,
    Plan,
    measure_contention,
    measure_link,
    plan,
    predict,
    profile_model,
)
from pipeline.splitting.partition import partition
from pipeline.splitting.profile import layer_params
from schedules.files import write_atomic

__all__ = ["Config", "main", "measure"]

Config = tuple[str, tuple[tuple[str, int], ...], int, str, tuple[int, ...]]  # schedule, options,
# chunks, checkpoint, balance
_P = 2


def _key(c: Config) -> str:
    name, opts, m, ckpt, balance = c
    extra = "".join(f" {k}={v}" for k, v in opts if k != "num_batches")
    return f"{name}{extra} m={m} {ckpt} {list(balance)}"


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


def _run(name: str, config: Config, steps: int, rank: int | None,
         memory: bool) -> tuple[list[float], list[int]]:
    """Build the config's Pipe, warm up, time `steps` steps; with `memory`, also each rank's
    measured peak (static bytes after an Adam step with lr 0, plus the stash it tracked)."""
    sched, opts, m, ckpt, balance = config
    spec = get_model(name)
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    kwargs: dict[str, Any] = {"balance": list(balance), "chunks": m, "schedule": sched,
                              "checkpoint": ckpt, "track_memory": memory}
    if rank is None:
        kwargs["devices"] = ["cpu"] * _P
    pipe = Pipe(model, **kwargs)
    times: list[float] = []
    peaks: list[int] = []
    try:
        pipe.step(x, y, loss)  # warm-up: the schedule is built, buffers are allocated
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            pipe.step(x, y, loss)
            times.append(time.perf_counter() - start)
        if memory:
            optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
            optimizer.step()  # allocates the state Adam keeps
            stash = [s["peak_stashed_bytes"] for s in pipe.memory_stats()]
            layers = list(model)
            order = schedules.get_schedule(sched, _P, m, **dict(opts))
            bounds = [0]
            for b in balance:
                bounds.append(bounds[-1] + b)
            mine = range(_P) if rank is None else [rank]
            for i, r in enumerate(mine):
                own = [layer for s in order.stages_of(r) for layer in
                       layers[bounds[s]:bounds[s + 1]]]
                peaks.append(_static(own, optimizer) + stash[i])
    finally:
        pipe.close()
    return times, peaks


def _measure_here(name: str, configs: Sequence[Config], steps: int, rounds: int,
                  rank: int | None) -> dict[str, Any]:
    """Every config `rounds` times in turn (a Pipe built for each turn), `steps` steps each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out: dict[str, Any] = {_key(c): {"times": [], "peaks": []} for c in configs}
        for r in range(rounds):
            for c in configs:
                times, peaks = _run(name, c, steps, rank, memory=r == 0)
                out[_key(c)]["times"] += times
                if peaks:
                    out[_key(c)]["peaks"] = peaks
        return out
    finally:
        torch.set_num_threads(threads)


def _rank(rank: int, name: str, configs: Sequence[Config], steps: int,
          rounds: int) -> dict[str, Any]:
    return _measure_here(name, configs, steps, rounds, rank)


def measure(name: str, configs: Sequence[Config], *, transport: str, steps: int,
            rounds: int) -> dict[str, dict[str, Any]]:
    """Per config: measured step seconds (every sample) and peak bytes per rank."""
    if transport == "threads":
        return _measure_here(name, configs, steps, rounds, None)
    per_rank = spawn(_rank, _P, name, list(configs), steps, rounds, timeout=7200.0)
    merged = per_rank[0]
    for key in merged:  # rank 0's times; every rank's own peak
        merged[key]["peaks"] = [per_rank[r][key]["peaks"][0] for r in range(_P)]
    return dict(merged)


def _config(c: Candidate) -> Config:
    assert c.balance is not None
    return (c.schedule, c.options, c.chunks, c.checkpoint, c.balance)


def _space(p: Plan, profile: ModelProfile, link: Link, budget: float) -> list[Config]:
    """Every fitting configuration of the plan's table (pruned ones predicted on their own)."""
    out: list[Config] = []
    for c in p.candidates:
        if c.status in ("chosen", "fits"):
            out.append(_config(c))
        elif c.status == "pruned":
            alone = predict(profile, link, schedule=c.schedule, chunks=c.chunks,
                            checkpoint=c.checkpoint, options=c.options, pp=c.pp,
                            contention=p.contention)
            if alone.peak_bytes is not None and max(alone.peak_bytes) <= budget:
                out.append(_config(alone))
    return list(dict.fromkeys(out))


def _summary(samples: list[float]) -> float:
    return statistics.median(samples)


def run(name: str, transport: str, *, chunks: Sequence[int], screen_steps: int, rounds: int,
        final: int, profile: ModelProfile) -> dict[str, Any]:
    spec = get_model(name)
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    link = measure_link("threads" if transport == "threads" else "gloo")
    contention = measure_contention(model, x, ranks=_P)
    default_balance = tuple(partition(layer_params(model), _P))
    default = predict(profile, link, schedule="1f1b", chunks=_P, checkpoint="except_last",
                      balance=default_balance, contention=contention)
    assert default.peak_bytes is not None and default.step_time is not None
    budget = max(default.peak_bytes)
    start = time.perf_counter()
    chosen = plan(model, x, y, loss, ranks=_P, memory_per_rank=budget, profile=profile,
                  link=link, chunks=chunks, transport="threads" if transport == "threads"
                  else "gloo", data_parallel=[1], contention=contention)
    planning_s = time.perf_counter() - start
    space = _space(chosen, profile, link, budget)
    plan_cfg = _config(chosen.chosen)
    default_cfg: Config = ("1f1b", (), _P, "except_last", default_balance)
    screen = measure(name, space, transport=transport, steps=screen_steps, rounds=1)
    fitting = [c for c in space if max(screen[_key(c)]["peaks"]) <= budget]
    ranked = sorted(fitting, key=lambda c: _summary(screen[_key(c)]["times"]))
    finalists = list(dict.fromkeys([plan_cfg, default_cfg, *ranked[:final]]))
    last = measure(name, finalists, transport=transport, steps=2, rounds=rounds)
    within = [c for c in finalists if max(last[_key(c)]["peaks"]) <= budget]
    best = min(within, key=lambda c: _summary(last[_key(c)]["times"]))

    def row(c: Config, prediction: Candidate) -> dict[str, Any]:
        got = last[_key(c)]
        return {"config": _key(c), "predicted_step_s": prediction.step_time,
                "predicted_peak_bytes": list(prediction.peak_bytes or ()),
                "measured_step_s": _summary(got["times"]), "measured_samples": got["times"],
                "measured_peak_bytes": got["peaks"]}

    def prediction_of(c: Config) -> Candidate:
        return predict(profile, link, schedule=c[0], options=c[1], chunks=c[2],
                       checkpoint=c[3], balance=c[4], contention=contention)

    return {
        "model": name, "transport": transport, "ranks": _P, "budget_bytes": budget,
        "link": {"latency_s": link.latency, "per_byte_s": link.per_byte},
        "contention": contention,
        "planning_s": planning_s, "space": len(space),
        "screen": {_key(c): {"median_s": _summary(screen[_key(c)]["times"]),
                             "peaks": screen[_key(c)]["peaks"]} for c in space},
        "plan": row(plan_cfg, prediction_of(plan_cfg)),
        "default": row(default_cfg, prediction_of(default_cfg)),
        "best": row(best, prediction_of(best)),
        "plan_over_best": _summary(last[_key(plan_cfg)]["times"])
        / _summary(last[_key(best)]["times"]),
    }


def report(records: Sequence[dict[str, Any]]) -> str:
    """The results as markdown: one table of plan / default / best per model and transport."""
    lines = ["| model | transport | budget | which | configuration | predicted step | "
             "measured step | predicted peak | measured peak |", "|---|---|---|---|---|---|---|"
             "---|---|"]
    for r in records:
        for which in ("plan", "default", "best"):
            row = r[which]
            lines.append(
                f"| {r['model']} | {r['transport']} | {r['budget_bytes'] / 2**20:.1f} MiB | "
                f"{which} | {row['config']} | {row['predicted_step_s'] * 1e3:.1f} ms | "
                f"{row['measured_step_s'] * 1e3:.1f} ms | "
                f"{max(row['predicted_peak_bytes']) / 2**20:.1f} MiB | "
                f"{max(row['measured_peak_bytes']) / 2**20:.1f} MiB |")
    lines += ["", "| model | transport | plan / best (measured) | within 10% | plan's measured "
              "peak within budget | configurations measured | planning s |",
              "|---|---|---|---|---|---|---|"]
    for r in records:
        ratio = r["plan_over_best"]
        fits = max(r["plan"]["measured_peak_bytes"]) <= r["budget_bytes"]
        lines.append(f"| {r['model']} | {r['transport']} | {ratio:.3f} | "
                     f"{'yes' if ratio <= 1.10 else 'no'} | {'yes' if fits else 'no'} | "
                     f"{r['space']} | {r['planning_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,transformer,unbalanced")
    parser.add_argument("--transports", default="threads,processes")
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--screen-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--final", type=int, default=3, help="screened configs re-measured")
    parser.add_argument("--out", type=Path, default=Path("bench-out/planning"))
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for name in args.models.split(","):
        spec = get_model(name)
        model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        rows = sorted({-(-len(x) // m) for m in chunks})
        profile = profile_model(model, x, y, loss, rows=rows, repeats=5)
        torch.set_num_threads(threads)
        for transport in args.transports.split(","):
            record = run(name, transport, chunks=chunks, screen_steps=args.screen_steps,
                         rounds=args.rounds, final=args.final, profile=profile)
            records.append(record)
            print(f"{name} {transport}: plan/best {record['plan_over_best']:.3f}", flush=True)
            write_atomic(args.out / "results.json", json.dumps(
                {"environment": environment(), "records": records}, indent=1))
    write_atomic(args.out / "report.md", report(records))
    print(report(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
