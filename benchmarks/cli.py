"""`python -m benchmarks`: run a suite, write JSON records, the markdown report and the plots."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import queue
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks import data_parallel, lengths, one_gpu
from benchmarks.config import SUITES, Group, fit_to_gpus, groups, narrow, num_units
from benchmarks.env import environment
from benchmarks.gate import StartGate
from benchmarks.harness import Measured, merge_ranks, resolve_balances, roles, run_rank
from benchmarks.plots import write_plots
from benchmarks.records import build_records, validate_record
from benchmarks.report import render_data_parallel, render_markdown
from pipeline.examples.models import get_model
from pipeline.launch import RankFailed, spawn
from pipeline.planner import contention
from schedules import Timeline, available
from schedules.files import write_atomic

__all__ = ["advance", "load_summary", "main", "run_data_parallel", "run_group", "write_outputs"]

_GROUP_TIMEOUT = 7200.0
_log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure ours against torch.distributed.pipelining, the plain model and "
                    "the hardware bound, side by side, and check the simulator.")
    p.add_argument("--suite", choices=[*sorted(SUITES), "dp", "gpu", "lengths"],
                   default="quick",
                   help="quick: a tiny model for CI (about half a minute on an idle 2-core "
                        "machine, 2 minutes on a busy one); full: the README's "
                        "numbers; dp: pipeline x data parallelism on 4 processes (2x2, 1x4 "
                        "and DDP 4x1); gpu: one device, one process: the plain model, ours "
                        "(1, 2, 4 stages) and torch's, at a launch-bound and a compute-bound "
                        "size; lengths: counted tokens/s on speeches of natural length, "
                        "padded to the corpus, to the batch, or cut to their tokens")
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="directory for results.jsonl, report.md, timelines/ and plots/")
    p.add_argument("--models", help="comma-separated: mlp, transformer, unbalanced, tiny")
    p.add_argument("--ranks", help="comma-separated rank counts, e.g. 1,2")
    p.add_argument("--microbatches", help="comma-separated micro-batch counts, e.g. 4,8,16")
    p.add_argument("--schedules", help=f"comma-separated, of: {', '.join(available())}")
    p.add_argument("--transport", help="threads, processes, or both comma-separated")
    p.add_argument("--warmup", type=int, help="untimed rounds first (suite's default)")
    p.add_argument("--repeats", type=int, help="timed rounds (suite's default)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA with NCCL when GPUs exist, else CPU with gloo")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log what runs to stderr (-v: groups and balances, -vv: more)")
    p.add_argument("--no-plots", action="store_true", help="skip the SVG/PNG plots")
    return p


def advance(bar: tqdm[Any], n: int = 1) -> None:
    """Count `n` units done. The unit that completes the bar is counted without drawing it:
    `close()` draws the bar once more, so a bar already drawn at 100 % would show its last
    line twice wherever carriage returns do not overwrite it (a log, CI)."""
    if bar.total is not None and bar.n + n >= bar.total:
        bar.n += n
    else:
        bar.update(n)


def run_group(group: Group, bar: tqdm[Any]) -> dict[int, Measured]:
    """Spawn the group's processes, advance the bar as each micro-batch count finishes, and
    return the merged measurements, with the load average before and after them. Raises
    RankFailed if a process fails."""
    n = len(roles(group))
    ctx = mp.get_context("spawn")
    gate, progress = StartGate(ctx, n), ctx.Queue()
    load_before = contention.load_average()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(spawn, run_rank, n, group, gate, progress,
                             timeout=_GROUP_TIMEOUT)
        while True:
            try:
                m = progress.get(timeout=0.2)
                bar.set_postfix_str(f"{group.name} m={m}", refresh=False)
                advance(bar)
            except queue.Empty:
                if future.done():
                    break
        per_rank = future.result()
    load = (load_before, contention.load_average())
    return {m: replace(measured, load=load) for m, measured in merge_ranks(per_rank).items()}


def load_summary(run: contention.Reading | None, records: Sequence[dict[str, Any]]
                 ) -> dict[str, Any]:
    """environment.json's `load`: the load average before and after the run, its CPU and
    wall seconds, the CPU seconds other programs took meanwhile (None where unknown), and the
    configurations with a figure measured under contention."""
    flagged = [r["id"] for r in records
               if any((cell or {}).get("contended") for cell in
                      (r.get("contention") or {}).values())]
    return {"cores": contention.cores(),
            "load_before": None if run is None else run.load_before,
            "load_after": None if run is None else run.load_after,
            "cpu_s": None if run is None else run.cpu_s,
            "wall_s": None if run is None else run.wall_s,
            "others_cpu_s": None if run is None else run.others_cpu_s,
            "others_limit": contention.OTHERS_LIMIT,
            "cpu_share_floor": contention.CPU_SHARE_FLOOR, "contended_cells": flagged}


def _device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here; use --device cpu")
    return choice


def _check(args: argparse.Namespace) -> None:
    """Refuse, before anything is measured, what would fail (or be lost) after measuring."""
    unknown = [s for s in (args.schedules or "").split(",") if s and s not in available()]
    if unknown:
        raise ValueError(f"unknown schedule {unknown[0]!r}; known: {', '.join(available())}")
    for name in ("warmup", "repeats"):
        value, least = getattr(args, name), int(name == "repeats")
        if value is not None and value < least:
            raise ValueError(f"--{name} must be >= {least} (got {value})")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file; name a directory (it is created if "
                         f"missing) for results.jsonl, report.md, timelines/ and plots/")


def write_outputs(out: Path, records: Sequence[dict[str, Any]], timelines: dict[str, Timeline],
                  env: dict[str, Any], *, suite: str, command: str,
                  failures: Sequence[str] = (), notes: Sequence[str] = (),
                  plots: bool = True) -> list[Path]:
    """results.jsonl (one record per line), environment.json, timelines/*.json, report.md and
    plots/; returns what was written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "timelines").mkdir(exist_ok=True)
    written = []
    for r in records:
        tl = timelines.get(r["id"])
        if tl is not None:
            path = out / "timelines" / (r["id"].replace("/", "_") + ".json")
            write_atomic(path, tl.to_json())
            r["timeline"] = str(path.relative_to(out))
        validate_record(r)
    results = out / "results.jsonl"
    write_atomic(results, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    write_atomic(out / "environment.json", json.dumps(env, indent=2) + "\n")
    report = out / "report.md"
    write_atomic(report, render_markdown(records, env, suite=suite, command=command,
                                         failures=failures, notes=notes))
    written += [results, out / "environment.json", report]
    if plots and records:
        written += write_plots(out / "plots", records, timelines)
    return written


def _dp_suite(args: argparse.Namespace, device: str) -> data_parallel.DpSuite:
    """The dp suite, narrowed by the flags that apply to it (one value each)."""
    for flag in ("ranks", "transport"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} does not apply to --suite dp: it runs 4 processes as "
                             f"2x2 and 1x4 meshes and as DDP")
    chosen: dict[str, Any] = {"device": device}
    for flag, field, convert in (("models", "model", str), ("schedules", "schedule", str),
                                 ("microbatches", "chunks", int), ("warmup", "warmup", int),
                                 ("repeats", "repeats", int)):
        value = getattr(args, flag)
        if value is None:
            continue
        if isinstance(value, str) and "," in value:
            raise ValueError(f"--{flag} takes one value with --suite dp (got {value!r})")
        try:
            chosen[field] = convert(value)
        except ValueError:
            raise ValueError(f"--{flag} takes a whole number (got {value!r})") from None
    if "model" in chosen:
        get_model(chosen["model"])  # raises on an unknown name
    if chosen.get("chunks", 1) < 1:
        raise ValueError(f"--microbatches must be >= 1 (got {chosen['chunks']})")
    return data_parallel.DpSuite(**chosen)


def run_data_parallel(suite: data_parallel.DpSuite, out: Path, *, command: str) -> int:
    """Measure the dp suite; write results.jsonl, environment.json and report.md."""
    env = environment(suite.device)
    gpus = torch.cuda.device_count() if suite.device == "cuda" else 0
    try:
        with contention.Meter(contention.cores(), children=True) as meter:
            records, notes = data_parallel.run_suite(suite, env, num_gpus=gpus)
    except RankFailed as exc:
        print(f"python -m benchmarks: the dp suite failed:\n{exc}", file=sys.stderr)
        return 1
    env["load"] = load_summary(meter.reading, records)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n"
                                                for r in records))
    write_atomic(out / "environment.json", json.dumps(env, indent=2) + "\n")
    write_atomic(out / "report.md", render_data_parallel(records, env, command=command,
                                                         notes=notes))
    print(f"{len(records)} configurations; report: {out / 'report.md'}, "
          f"records: {out / 'results.jsonl'}")
    return 0


def run_lengths(args: argparse.Namespace, command: str) -> int:
    """The lengths suite (benchmarks/lengths.py): one table, in report.md and results.json."""
    suite = lengths.LengthsSuite(**{k: v for k, v in (("warmup", args.warmup),
                                                      ("repeats", args.repeats))
                                    if v is not None})
    with contention.Meter(contention.cores(), children=True) as meter:
        result = lengths.run_suite(suite)
    env = {**environment("cpu"), "load": load_summary(meter.reading, [])}
    table = lengths.render(result, command, f"{env.get('cpu', 'cpu')}, torch "
                                            f"{torch.__version__}")
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "report.md", table + "\n")
    write_atomic(args.out / "results.json", json.dumps({**result, "environment": env}) + "\n")
    print(table)
    return 0


def run_one_device(args: argparse.Namespace, device: str, command: str) -> int:
    """The gpu suite (benchmarks/one_gpu.py): one table, in report.md and results.json."""
    chosen = {k: v for k, v in (("warmup", args.warmup), ("repeats", args.repeats))
              if v is not None}
    if args.microbatches:
        chosen["microbatches"] = [int(m) for m in args.microbatches.split(",")]
    with contention.Meter(contention.cores(), children=True) as meter:
        result = one_gpu.run_suite(torch.device(device), **chosen)
    env = {**environment(device), "load": load_summary(meter.reading, [])}
    where = ", ".join(env["gpu"]) if env.get("gpu") else env.get("cpu", device)
    table = one_gpu.render(result, command, f"{where}, torch {torch.__version__}")
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "report.md", table)
    write_atomic(args.out / "results.json", json.dumps({**result, "environment": env}) + "\n")
    print(table)
    return 0


def _measure(chosen: Sequence[Group], bar: tqdm[Any], env: dict[str, Any]
             ) -> tuple[list[dict[str, Any]], dict[str, Timeline], list[str]]:
    """Run each group: its records, the timelines of their median steps, and the failures."""
    records: list[dict[str, Any]] = []
    timelines: dict[str, Timeline] = {}
    failures: list[str] = []
    for group in chosen:
        group = resolve_balances(group)
        _log.info("group %s: %d processes, micro-batches %s", group.name,
                  len(roles(group)), list(group.microbatches))
        try:
            measured = run_group(group, bar)
        except RankFailed as exc:
            failures.append(f"{group.name}: {str(exc).splitlines()[0]}")
            bar.write(f"group {group.name} failed:\n{exc}", file=sys.stderr)
            bar.set_postfix_str(f"{group.name} failed", refresh=False)
            advance(bar, len(group.microbatches))
            continue
        for record, timeline in build_records(group, measured, env):
            records.append(record)
            if timeline is not None:
                timelines[record["id"]] = timeline
    return records, timelines, failures


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.verbose:  # the library logs but configures nothing; the command line may
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(asctime)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    command = ("python -m benchmarks " + " ".join(argv)).strip()
    dp_suite = None
    try:
        _check(args)
        device = _device(args.device)
        if args.suite == "lengths":
            return run_lengths(args, command)
        if args.suite == "gpu":
            return run_one_device(args, device, command)
        if args.suite == "dp":
            dp_suite = _dp_suite(args, device)
        else:
            suite = narrow(SUITES[args.suite], models=args.models, ranks=args.ranks,
                           microbatches=args.microbatches, schedules=args.schedules,
                           transports=args.transport, warmup=args.warmup,
                           repeats=args.repeats)
    except ValueError as exc:
        print(f"python -m benchmarks: {exc}", file=sys.stderr)
        return 2
    if dp_suite is not None:
        return run_data_parallel(dp_suite, args.out, command=command)
    chosen = groups(suite, device=device)
    notes: list[str] = []
    if device == "cuda":
        chosen, notes = fit_to_gpus(chosen, torch.cuda.device_count())
    if not chosen:
        print("python -m benchmarks: nothing to run with these filters", file=sys.stderr)
        return 2
    env = environment(device)
    # One unit per (group, micro-batch count), on stderr.
    bar = tqdm(total=num_units(chosen), disable=args.no_progress, unit="run",
               dynamic_ncols=True)
    # The whole run's CPU time: this process and the groups' processes (its children).
    with contention.Meter(contention.cores(), children=True) as meter:
        records, timelines, failures = _measure(chosen, bar, env)
    bar.close()
    env = {**env, "load": load_summary(meter.reading, records)}
    write_outputs(args.out, records, timelines, env, suite=suite.name, command=command,
                  failures=failures, notes=notes, plots=not args.no_plots)
    print(f"{len(records)} configurations measured; report: {args.out / 'report.md'}, "
          f"records: {args.out / 'results.jsonl'}")
    return 1 if failures else 0
