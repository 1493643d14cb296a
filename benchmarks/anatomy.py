"""`python -m benchmarks.anatomy`: where a step's time goes, per rank, beside the ideal pipeline.

    python -m benchmarks.anatomy --model mlp --ranks 2 --microbatches 4,8,16 \\
        --schedule 1f1b --transport processes --steps 9 --out bench-out/anatomy

For each micro-batch count, a Pipe takes its steps in turn with each rank's compute alone (its
stages' forwards and backwards of every micro-batch on inputs prepared beforehand, sending
nothing: the benchmarks' hardware bound), run on every rank at the same time so that they
contend as in the pipeline. Each step's record (the timeline, and what the runtime records
beside it: waits for peers, SEND/RECV actions, the step's phases) is split by
`benchmarks.anatomy_parts.split_step` into compute, runtime between actions, waits for a peer,
syncs and time outside the schedule, which add up to the step; the ideal pipeline is the
slowest rank's compute alone x (m + p - 1) / m. With `--out`, the records, the tables, and per
micro-batch count the median step's timeline, its prediction, and both drawn by pipeviz.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.anatomy_parts import RankRecord, timeline_of
from benchmarks.anatomy_report import Summary, render, render_summary, summarize_rounds
from benchmarks.config import stages_per_rank
from benchmarks.env import environment
from benchmarks.gate import StartGate, quiet
from benchmarks.harness import _bound_work, _chunks
from benchmarks.records import schedule_for
from pipeline import Pipe
from pipeline.examples.models import MODELS, balance_for, get_model
from pipeline.launch import spawn
from schedules.files import write_atomic
from viz.cli import main as pipeviz
from viz.measured import predicted

__all__ = ["Config", "main", "measure", "records_of", "report", "run_rank"]

_TIMEOUT = 600.0  # seconds a process waits for the others at a step's start


@dataclass(frozen=True)
class Config:
    """What to run: model, ranks, micro-batch counts, schedule, transport, steps."""

    model: str = "mlp"
    ranks: int = 2
    microbatches: tuple[int, ...] = (4, 8, 16)
    schedule: str = "1f1b"
    transport: str = "processes"
    steps: int = 9
    warmup: int = 2
    balance: tuple[int, ...] = ()  # empty: by parameter count, as the benchmarks split


def records_of(pipe: Pipe, call: tuple[float, float]) -> list[RankRecord]:
    """What the last step recorded on this process's ranks, on the shared clock."""
    # Pipe gives the timeline; the runtime keeps the rest beside it (waits, SEND/RECV actions,
    # the step's phases) on its executor, which Pipe does not expose.
    executor = pipe._executor
    t0 = float(pipe.last_timeline().meta["t0"])
    out = []
    for rt in executor.runtimes:
        out.append(RankRecord(
            rt.rank, call, (t0 + rt.span[0], t0 + rt.span[1]),
            tuple((str(e.action), t0 + e.start, t0 + e.end) for e in rt.events),
            tuple((str(e.action), t0 + e.start, t0 + e.end) for e in rt.comm),
            tuple((msg, t0 + s, t0 + e) for msg, s, e in rt.waits),
            dict(executor.phases)))
    return out


def _alone(works: Sequence[Callable[[], None]]) -> list[float]:
    """Each work's seconds, all started at once (one thread each when there are several)."""
    if len(works) == 1:
        start = time.perf_counter()
        works[0]()
        return [time.perf_counter() - start]
    took = [0.0] * len(works)
    barrier = threading.Barrier(len(works))

    def run(i: int) -> None:
        barrier.wait()
        start = time.perf_counter()
        works[i]()
        took[i] = time.perf_counter() - start

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(works))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took


def run_rank(rank: int | None, cfg: Config, balance: Sequence[int],
             gate: StartGate | None) -> dict[int, list[dict[str, Any]]]:
    """One process's rounds per micro-batch count: its ranks' records of each timed step and
    their compute alone (rank None: the threads transport, every rank in this process)."""
    torch.set_num_threads(1)  # as the other suites: one intra-op thread per rank
    spec = get_model(cfg.model)
    model = spec.build()
    x, y = spec.batch()
    loss_fn = spec.loss()
    p = cfg.ranks
    mine = list(range(p)) if rank is None else [rank]
    out: dict[int, list[dict[str, Any]]] = {}
    for m in cfg.microbatches:
        pipe = Pipe(model, list(balance), chunks=m, schedule=cfg.schedule, checkpoint="never",
                    devices=["cpu"] * p if rank is None else None)
        plan = schedule_for(cfg.schedule, p, m)
        chunks = _chunks(x, y, m)
        works = [_bound_work(model, balance, plan.stages_of(r), chunks, loss_fn,
                             torch.device("cpu")) for r in mine]
        rounds = []
        gc.collect()
        gc.disable()  # a collection inside a step would be charged to it alone
        try:
            for i in range(cfg.warmup + cfg.steps):
                got: dict[str, Any] = {}
                # In turn, the order swapped every round: drift falls on both alike.
                for what in ("pipe", "alone") if i % 2 == 0 else ("alone", "pipe"):
                    model.zero_grad(set_to_none=True)
                    if gate is not None:
                        gate.start(True, _TIMEOUT)
                    if what == "pipe":
                        start = time.perf_counter()
                        pipe.step(x, y, loss_fn)
                        call = (start, time.perf_counter())
                        got["records"] = [r.to_dict() for r in records_of(pipe, call)]
                    else:
                        got["alone"] = dict(zip(mine, _alone(works), strict=True))
                    quiet()  # untimed: this process's threads settle before the next start
                if i >= cfg.warmup:
                    rounds.append(got)
                gc.collect()
        finally:
            gc.enable()
            pipe.close()
        out[m] = rounds
    return out


def _merge(per_process: Sequence[dict[int, list[dict[str, Any]]]], m: int
           ) -> list[tuple[list[RankRecord], list[float]]]:
    rounds = []
    for i in range(len(per_process[0][m])):
        records = [RankRecord.from_dict(r) for proc in per_process
                   for r in proc[m][i]["records"]]
        alone: dict[int, float] = {}
        for proc in per_process:
            alone.update({int(k): float(v) for k, v in proc[m][i]["alone"].items()})
        rounds.append((sorted(records, key=lambda r: r.rank),
                       [alone[r] for r in sorted(alone)]))
    return rounds


def measure(cfg: Config) -> tuple[list[int], dict[int, list[tuple[list[RankRecord], list[float]]]]]:
    """Run `cfg`: the balance used, and per micro-batch count each timed round's records of
    every rank and every rank's compute alone."""
    v = stages_per_rank(cfg.schedule)
    balance = list(cfg.balance) or balance_for(get_model(cfg.model), "params", cfg.ranks * v)
    if cfg.transport == "threads":
        per_process = [run_rank(None, cfg, balance, None)]
    else:
        gate = StartGate(mp.get_context("spawn"), cfg.ranks)
        per_process = spawn(run_rank, cfg.ranks, cfg, balance, gate, timeout=3600.0)
    return balance, {m: _merge(per_process, m) for m in cfg.microbatches}


def _write_step(out: Path, m: int, records: Sequence[RankRecord], cfg: Config,
                balance: Sequence[int]) -> None:
    """The step's measured timeline, its prediction, and pipeviz's drawing of both."""
    meta = {"schedule": cfg.schedule, "num_ranks": cfg.ranks, "num_stages": len(balance),
            "num_microbatches": m, "model": cfg.model, "transport": cfg.transport}
    measured = timeline_of(records, meta)
    base = out / "timelines" / f"m{m}"
    base.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(f"{base}-measured.json"), measured.to_json())
    write_atomic(Path(f"{base}-predicted.json"), predicted(measured).to_json())
    pipeviz([f"{base}-measured.json", "--predicted", "-o", f"{base}-measured-vs-predicted.svg"])


def report(cfg: Config, balance: Sequence[int], summaries: Sequence[Summary],
           command: str) -> str:
    """The markdown report: the summary across micro-batch counts, then each one's table."""
    head = (f"# The anatomy of a step\n\n`{command}`\n\n{cfg.model}, balance {list(balance)}, "
            f"{cfg.ranks} ranks ({cfg.transport}), {cfg.schedule}; {cfg.steps} timed steps "
            f"after {cfg.warmup}, each beside the ranks' compute alone.\n")
    tables = [render(s, f"m = {s.num_microbatches}") for s in summaries]
    return "\n\n".join([head, render_summary(summaries), *tables]) + "\n"


def _load(path: Path) -> tuple[Config, list[int], dict[int, list[tuple[list[RankRecord],
                                                                       list[float]]]]]:
    data = json.loads(path.read_text())
    c = data["config"]
    cfg = Config(**{**c, "microbatches": tuple(c["microbatches"]),
                    "balance": tuple(c["balance"])})
    rounds = {int(m): [([RankRecord.from_dict(r) for r in rnd["records"]],
                        [float(v) for v in rnd["alone_s"]]) for rnd in per]
              for m, per in data["rounds"].items()}
    return cfg, list(data["balance"]), rounds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.anatomy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", default="4,8,16", help="comma-separated counts")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--transport", default="processes", choices=("processes", "threads"))
    parser.add_argument("--steps", type=int, default=9, help="timed steps per count")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--balance", default="", help="layers per stage, e.g. 4,5 (default: "
                                                      "by parameter count)")
    parser.add_argument("--out", type=Path, default=None, help="write results, report, "
                                                                "timelines and drawings here")
    parser.add_argument("--from", dest="load", type=Path, default=None, metavar="RESULTS",
                        help="measure nothing: the tables of a results.json written before")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--ranks and --steps must be at least 1, --warmup at least 0")
    cfg = Config(args.model, args.ranks, tuple(int(v) for v in args.microbatches.split(",")),
                 args.schedule, args.transport, args.steps, args.warmup,
                 tuple(int(v) for v in args.balance.split(",") if v))
    if args.load is not None:
        cfg, balance, rounds = _load(args.load)
    else:
        balance, rounds = measure(cfg)
    v = stages_per_rank(cfg.schedule)
    summaries = [summarize_rounds(rounds[m], m, v) for m in cfg.microbatches]
    command = "python -m benchmarks.anatomy " + " ".join(
        sys.argv[1:] if argv is None else argv)
    text = report(cfg, balance, summaries, command.strip())
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "report.md", text)
        write_atomic(args.out / "results.json", json.dumps({
            "config": asdict(cfg), "balance": list(balance), "environment": environment("cpu"),
            "summaries": [s.to_dict() for s in summaries],
            "rounds": {str(m): [{"records": [r.to_dict() for r in recs], "alone_s": alone}
                                for recs, alone in rounds[m]] for m in cfg.microbatches}},
            indent=1))
        for s in summaries:
            _write_step(args.out, s.num_microbatches, rounds[s.num_microbatches][s.median_round][0],
                        cfg, balance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
