"""The planning benchmark's run: profile, plan, measure every configuration, record, report."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.env import environment
from benchmarks.planning.calibrate import calibrate
from benchmarks.planning.held_out import time_model_what_if
from benchmarks.planning.record import (
    config_rows,
    error_sources,
    results_for,
    timeline_json,
)
from benchmarks.planning.report import report
from benchmarks.planning.rounds import Measured, measure, orders, steps_of
from benchmarks.planning.space import (
    Config,
    Entry,
    Predictor,
    allreduce_seconds,
    build_space,
    from_candidate,
    predictor,
)
from pipeline.examples.models import get_model
from pipeline.launch import spawn
from pipeline.planner import (
    ModelProfile,
    Plan,
    PlanError,
    TimeModel,
    measure_contention,
    measure_link,
    plan,
    profile_model,
)
from pipeline.splitting.partition import partition
from pipeline.splitting.profile import layer_params
from schedules.files import write_atomic

__all__ = ["BUDGETS", "USAGE", "main", "planned_on_ranks", "profile_rows", "run"]

BUDGETS = ("default", "none")

USAGE = """\
    python -m benchmarks.planning --out benchmarks/results/planning

For each model and transport (p ranks, 2 by default): profile the model once (one thread),
measure the link and how much ranks computing at once slow each other; take the default
configuration (dp 1, `1f1b`, `balance="params"`, `chunks=p`, `checkpoint="except_last"`) and
plan under each budget: "default" (the default's predicted peak per rank) and "none"
(unbounded; with processes the planner also chooses dp x pp). Then measure, alike, every
configuration predicted to fit either budget (each schedule, checkpoint mode, chunk count and
dp x pp shape with the split the planner gives it), the splits one layer away from the
`--vary` predicted-fastest ones' under each budget (the plan's first), and the default;
configurations that run the same program are measured once. Every configuration takes one turn
per round, in an order shuffled anew each round; the plan and the default are two of them.
Reported per budget: the plan's and the default's rank among the configurations whose measured
peak fits, their regret against the fastest of them, with bootstrap intervals over the rounds;
per configuration, the predicted and measured step, and where the difference lies.
"""


def profile_rows(batch: int, ranks: int, chunks: Sequence[int], processes: bool) -> list[int]:
    """Rows per micro-batch the planner may ask for: each chunk count of each replica's batch
    (every dp dividing the ranks and the batch, with processes; dp 1 with threads)."""
    dps = [d for d in range(1, ranks + 1) if ranks % d == 0 and batch % d == 0] \
        if processes else [1]
    return sorted({-(-(batch // d) // m) for d in dps for m in chunks if m <= batch // d})


def run(name: str, transport: str, *, ranks: int, chunks: Sequence[int], budgets: Sequence[str],
        rounds: int, steps: int, warmup: int, vary: int, seed: int, replicates: int,
        profile: ModelProfile, profile_repeats: int = 5, out: Path | None = None,
        trials: int = 0) -> dict[str, Any]:
    """Plan, measure every configuration alike, and build the record of one model and
    transport (timelines of the plan's, the default's and the fastest's steps into `out`)."""
    began = time.perf_counter()
    spec = get_model(name)
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    threads = transport == "threads"
    link = measure_link("threads" if threads else "gloo")
    contention = measure_contention(model, x, ranks=ranks)
    predict = predictor(profile, link)
    default = Config("1f1b", (), ranks, "except_last",
                     tuple(partition(layer_params(model), ranks)), 1, ranks)
    guess = predict(default, contention)
    assert guess.peak_bytes is not None
    limits = {"default": max(guess.peak_bytes), "none": math.inf}
    plans, planning_s, failed = {}, {}, {}
    chunks = sorted({*chunks, ranks})  # the default's own chunk count is always a candidate
    for b in budgets:
        start = time.perf_counter()
        kwargs: dict[str, Any] = {
            "ranks": ranks, "profile": profile, "link": link, "chunks": chunks,
            "memory_per_rank": None if math.isinf(limits[b]) else limits[b],
            "transport": "threads" if threads else "gloo",
            "data_parallel": [1] if threads else None, "contention": contention,
            "trials": trials}
        try:
            plans[b] = (plan(model, x, y, loss, **kwargs) if threads or not trials else
                        spawn(planned_on_ranks, ranks, name, kwargs, timeout=1800)[0])
        except PlanError as exc:  # a finding, not a reason to lose the other budgets' runs
            failed[b] = str(exc)
            print(f"{name} {transport} budget {b}: no plan: {exc}", file=sys.stderr)
            continue
        planning_s[b] = time.perf_counter() - start
    entries = build_space(plans, limits, default, vary=vary, contention=contention,
                          profile=profile, link=link)
    configs = [e.config for e in entries]
    print(f"{name} {transport}: {len(configs)} configurations, {rounds} rounds", file=sys.stderr,
          flush=True)
    turns = orders(len(configs), rounds, seed)
    start = time.perf_counter()
    measured = measure(name, configs, transport=transport, ranks=ranks, turns=turns, steps=steps,
                       warmup=warmup)
    measure_s = time.perf_counter() - start
    drift = _drift(model, x, y, loss, profile, profile_repeats, contention, ranks)
    rows = config_rows(entries, measured, predict, contention,
                       lambda c: allreduce_seconds(profile, link, c))

    def step_time(c: Config, factor: float) -> float:
        got = predict(c, factor).step_time
        assert got is not None
        return got

    what_if = calibrate(configs, [r["measured"]["median_s"] for r in rows],
                        [max(r["predicted"]["anatomy"]["compute_actions"]) for r in rows],
                        step_time, contention)
    what_if["time_model"] = _held_out(configs, measured, rows, predict,
                                      [profile.batch_rows // (c.dp * c.chunks) for c in configs])
    results = {}
    for b in plans:
        chosen = from_candidate(plans[b].chosen)
        results[b] = results_for(rows, entries, limits[b], chosen, default,
                                 replicates=replicates, seed=seed)
        results[b]["plan"]["planning_s"] = planning_s[b]
        results[b]["plan"]["predicted_as_planned_s"] = plans[b].predicted_step_time
        results[b]["plan"]["trials"] = trials
        results[b]["plan"]["measured_in_trials_s"] = plans[b].measured_step_time
    if out is not None:
        _timelines(out, name, transport, entries, measured, rows, results, predict, contention)
    return {
        "model": name, "transport": transport, "ranks": ranks, "chunks": list(chunks),
        "rounds": rounds, "steps": steps, "warmup": warmup, "seed": seed,
        "replicates": replicates,
        "link": {"latency_s": link.latency, "per_byte_s": link.per_byte,
                 "collective_latency_s": link.collective_latency,
                 "collective_per_byte_s": link.collective_per_byte},
        "contention": contention, "drift": drift, "default_config": default.key,
        "orders": turns, "results": results, "plan_errors": failed,
        "error_sources": error_sources(rows),
        "what_if": what_if,
        "configs": rows, "measure_s": measure_s, "elapsed_s": time.perf_counter() - began,
    }


def planned_on_ranks(rank: int, name: str, kwargs: dict[str, Any]) -> Plan:
    """`plan(..., trials=k)` over processes runs on every rank of a launched group: each of
    `ranks` spawned ranks plans the model alike (rank 0's candidates, slowest rank's times)."""
    del rank
    spec = get_model(name)
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    torch.set_num_threads(1)
    return plan(model, x, y, loss, **kwargs)


def _held_out(configs: Sequence[Config], measured: Sequence[Sequence[Measured]],
              rows: Sequence[dict[str, Any]], predict: Predictor, sizes: Sequence[int]
              ) -> dict[str, Any]:
    """The fitted time model on held-out configurations (`held_out.time_model_what_if`)."""
    def with_model(c: Config, model: TimeModel) -> float:
        got = predict(c, 1.0, model).step_time
        assert got is not None
        return float(got)

    alone = [predict(c, 1.0).timeline for c in configs]
    assert all(tl is not None for tl in alone)
    return time_model_what_if(configs, [steps_of(measured, i) for i in range(len(configs))],
                              [tl for tl in alone if tl is not None],
                              [r["measured"]["median_s"] for r in rows], with_model, sizes)


def _drift(model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss: Any,
           profile: ModelProfile, repeats: int, contention: float, ranks: int
           ) -> dict[str, Any]:
    """The planner's inputs measured again after the steps: per micro-batch size the profiled
    forward + backward of all layers now / then, and the contention factor now. On a shared
    machine these are snapshots; how far they moved bounds how well any prediction can do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = profile_model(model, x, y, loss, rows=sorted(profile.by_rows), repeats=repeats)
    finally:
        torch.set_num_threads(threads)

    def total(costs: Any) -> float:
        return float(sum(costs.forward) + sum(costs.backward))

    return {"profile_after_over_before": {str(r): total(again.at(r)) / total(profile.at(r))
                                          for r in sorted(profile.by_rows)},
            "contention_before": contention,
            "contention_after": measure_contention(model, x, ranks=ranks)}


def _timelines(out: Path, name: str, transport: str, entries: Sequence[Entry],
               measured: Sequence[Sequence[Measured]], rows: Sequence[dict[str, Any]],
               results: dict[str, Any], predict: Predictor, contention: float) -> None:
    """The median measured step and the predicted step of the plan, the default and the
    fastest under each budget, as pipeviz reads them:
    timelines/<model>-<transport>-<who>-<budget>-{measured,predicted}.json."""
    folder = out / "timelines"
    folder.mkdir(parents=True, exist_ok=True)
    for budget, res in results.items():
        for who in ("plan", "default", "best"):
            key = res[who]["key"]
            i = next(j for j, r in enumerate(rows) if r["key"] == key)
            steps = sorted(steps_of(measured, i), key=lambda st: st[0])
            _, median = steps[(len(steps) - 1) // 2]
            stem = f"{name}-{transport}-{who}-{budget}"
            write_atomic(folder / f"{stem}-measured.json",
                         timeline_json(median, {"schedule": f"{key} (measured)"}))
            guess = predict(entries[i].config, contention)
            assert guess.timeline is not None
            write_atomic(folder / f"{stem}-predicted.json",
                         timeline_json(guess.timeline, {"schedule": f"{key} (predicted)"}))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planning", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,transformer,unbalanced")
    parser.add_argument("--transports", default="threads,processes")
    parser.add_argument("--ranks", type=int, default=2, help="p: processes or threads, 2 to 4")
    parser.add_argument("--chunks", default="1,2,4,8",
                        help="micro-batch counts (p, the default's, is always added)")
    parser.add_argument("--budgets", default=",".join(BUDGETS),
                        help="default: the default's predicted peak; none: unbounded")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per turn")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per turn")
    parser.add_argument("--vary", type=int, default=3,
                        help="predicted-fastest configurations whose split is varied")
    parser.add_argument("--replicates", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=0,
                        help="plan(..., trials=K): the K best predicted run first, the "
                             "measured fastest is the plan (over processes on spawned ranks)")
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench-out/planning"))
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="a results.json: write its report.md to --out, measuring nothing")
    args = parser.parse_args(argv)
    if args.source is not None:
        saved = json.loads(args.source.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "report.md", report(saved["records"], saved["command"]))
        return 0
    budgets = args.budgets.split(",")
    if not set(budgets) <= set(BUDGETS) or not 2 <= args.ranks <= 4 or args.rounds < 2:
        parser.error(f"--budgets among {BUDGETS}, --ranks 2 to 4, --rounds >= 2")
    chunks = sorted({*(int(c) for c in args.chunks.split(",")), args.ranks})
    transports = args.transports.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.planning " + shlex.join(sys.argv[1:] if argv is None
                                                             else list(argv))
    records = []
    began = time.perf_counter()
    for name in args.models.split(","):
        spec = get_model(name)
        model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # profile as the ranks run: one intra-op thread each
        rows = profile_rows(len(x), args.ranks, chunks, "processes" in transports)
        profile = profile_model(model, x, y, loss, rows=rows, repeats=args.profile_repeats)
        torch.set_num_threads(threads)
        for transport in transports:
            record = run(name, transport, ranks=args.ranks, chunks=chunks, budgets=budgets,
                         rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                         vary=args.vary, seed=args.seed, replicates=args.replicates,
                         profile=profile, profile_repeats=args.profile_repeats,
                         out=args.out, trials=args.trials)
            records.append(record)
            for b, res in record["results"].items():
                print(f"{name} {transport} budget {b}: plan rank {res['plan']['rank']} of "
                      f"{res['eligible']}, regret {res['plan']['regret']:.3f}; median |error| "
                      f"{record['error_sources']['error']['median_abs']:.3f}; "
                      f"{record['elapsed_s']:.0f} s", flush=True)
            write_atomic(args.out / "results.json", json.dumps(
                {"command": command, "environment": environment(), "records": records}))
    text = report(records, command)
    write_atomic(args.out / "report.md", text)
    print(text)
    print(f"{time.perf_counter() - began:.0f} s in all; measuring "
          f"{sum(r['measure_s'] for r in records):.0f} s", file=sys.stderr)
    return 0

