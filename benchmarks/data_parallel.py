"""Pipeline x data parallelism: dp x pp meshes of Pipe against plain DDP, on the same
processes, model and global batch, one step of each in turn (`python -m benchmarks --suite dp`).

Four processes run every configuration, so whatever else the machine does falls on all alike:

    2x2   Pipe on a ("dp", "pp") mesh of 2 x 2: two replicas of a 2-stage pipeline, each
          stepping half the global batch in `chunks` micro-batches
    1x4   Pipe on a 1 x 4 mesh: one 4-stage pipeline over the whole batch
    4x1   DistributedDataParallel on the whole model, each rank a quarter of the batch

Gradients are zeroed before each step, outside the timing; a step runs from the first process's
start to the last one's end (`harness.alternate`, `harness.merge_ranks`).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from benchmarks.config import Group, fit_to_gpus
from benchmarks.gate import StartGate
from benchmarks.harness import Measured, Variant, alternate, merge_ranks
from benchmarks.stats import RawEvent, summarize
from pipeline import Pipe
from pipeline.examples.models import balance_for, get_model
from pipeline.launch import spawn
from pipeline.runtime.saved_bytes import SavedBytes

__all__ = ["CONFIGS", "SCHEMA", "DpConfig", "DpSuite", "build_records", "run_rank",
           "run_suite"]

SCHEMA = "pipeline-dp-bench/1"
_NUM_PROCESSES = 4
_TIMEOUT = 600.0  # seconds a process waits at the barrier for the others


@dataclass(frozen=True)
class DpConfig:
    """One way to spread the model over the processes: `dp` replicas of `pp` stages."""

    name: str
    dp: int
    pp: int
    kind: str  # "pipe" (Pipe on a mesh) or "ddp" (DistributedDataParallel, no pipeline)


CONFIGS = (DpConfig("2x2", 2, 2, "pipe"), DpConfig("1x4", 1, 4, "pipe"),
           DpConfig("4x1", 4, 1, "ddp"))


@dataclass(frozen=True)
class DpSuite:
    """What the dp suite measures: one model, schedule and micro-batch count per replica."""

    model: str = "mlp"
    schedule: str = "1f1b"
    chunks: int = 4
    warmup: int = 3
    repeats: int = 21
    device: str = "cpu"


def _shard(t: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    rows = t.shape[0]
    return t[rows * dp_rank // dp:rows * (dp_rank + 1) // dp]


def _ddp_memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                loss_fn: nn.Module) -> dict[str, list[int]]:
    """One more, untimed step counted as Pipe counts its stash: the input plus what autograd
    saved in the forward (one micro-batch, alive from forward to backward)."""
    with SavedBytes() as saved:
        loss = loss_fn(model(x), y)
    loss.backward()
    return {"peak_stashed_bytes": [x.numel() * x.element_size() + saved.bytes],
            "peak_stashed_microbatches": [1]}


def run_rank(rank: int, suite: DpSuite, balances: dict[int, list[int]], gate: StartGate
             ) -> tuple[Measured, dict[str, list[dict[str, float]]], dict[str, int]]:
    """Body of each process: every configuration's steps in turn; then what this rank measured,
    its data-parallel stats per timed step (per Pipe) and its parameter bytes per config."""
    try:
        spec = get_model(suite.model)
        cuda = suite.device == "cuda"
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        x, y = (t.to(device) for t in spec.batch())
        loss_fn = spec.loss()
        variants: list[Variant] = []
        models: dict[str, nn.Module] = {}
        shards: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        dp_stats: dict[str, list[dict[str, float]]] = {}
        for c in CONFIGS:  # the same order on every rank: each constructor is collective
            model = spec.build()
            if c.kind == "ddp":
                xs, ys = _shard(x, rank, c.dp), _shard(y, rank, c.dp)
                models[c.name] = DistributedDataParallel(model.to(device),
                                                         device_ids=[rank] if cuda else None)
                variants.append(Variant(c.name, _step(models[c.name], xs, ys, loss_fn)))
            else:
                mesh = init_device_mesh(suite.device, (c.dp, c.pp), mesh_dim_names=("dp", "pp"))
                dp_rank = mesh.get_local_rank("dp")
                xs, ys = _shard(x, dp_rank, c.dp), _shard(y, dp_rank, c.dp)
                pipe = Pipe(model, balances[c.pp], chunks=suite.chunks, schedule=suite.schedule,
                            checkpoint="never", mesh=mesh)
                models[c.name] = pipe
                collect = _stats_into(pipe, dp_stats.setdefault(c.name, [])) if c.dp > 1 else None
                variants.append(Variant(c.name, _step(pipe, xs, ys, loss_fn), collect))
            shards[c.name] = (xs, ys)
        param_bytes = {name: sum(p.numel() * p.element_size() for p in m.parameters())
                       for name, m in models.items()}

        def prepare() -> None:
            for m in models.values():
                m.zero_grad(set_to_none=True)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(device)

        samples = alternate(variants, warmup=suite.warmup, repeats=suite.repeats,
                            prepare=prepare,
                            barrier=lambda taking: gate.start(taking, _TIMEOUT), sync=sync)
        memory: dict[str, dict[str, list[int]]] = {}
        for name, m in models.items():  # one more, untimed step each: the counting costs
            prepare()
            if isinstance(m, Pipe):
                m.track_memory = True
                m.step(*shards[name], loss_fn)
                m.track_memory = False
                memory[name] = {k: [s[k] for s in m.memory_stats()]
                                for k in ("peak_stashed_bytes", "peak_stashed_microbatches")}
            else:
                memory[name] = _ddp_memory(m, *shards[name], loss_fn)
        return Measured(samples, memory, {}), dp_stats, param_bytes
    except BaseException:
        gate.abort()  # wake the others at once instead of at their timeout
        raise


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
          loss_fn: nn.Module) -> Callable[[], object]:
    if isinstance(model, Pipe):
        pipe = model
        return lambda: pipe.step(x, y, loss_fn)

    def step() -> None:
        loss_fn(model(x), y).backward()
    return step


def _stats_into(pipe: Pipe, into: list[dict[str, float]]) -> Callable[[float], list[RawEvent]]:
    # Called after each timed step, outside its timing: keep the step's all-reduce figures.
    def collect(start: float) -> list[RawEvent]:
        into.append(pipe.data_parallel_stats())
        return []
    return collect


def _hidden(per_rank: Sequence[Sequence[dict[str, float]]]) -> dict[str, Any]:
    """Per timed step over all ranks: the share of all-reduce time hidden behind the pipeline
    (1 - total exposed / total all-reduce time); its summary over steps, and per rank."""
    steps = list(zip(*per_rank, strict=True))
    pooled = [1 - sum(s["exposed_s"] for s in step) / sum(s["allreduce_s"] for s in step)
              if sum(s["allreduce_s"] for s in step) > 0 else 1.0 for step in steps]
    return {"hidden_share": summarize(pooled).to_dict(),
            "hidden_share_per_rank": [statistics.median(s["hidden_share"] for s in r)
                                      for r in per_rank],
            "allreduce_s": summarize(max(s["allreduce_s"] for s in st) for st in steps).to_dict(),
            "exposed_s": summarize(max(s["exposed_s"] for s in st) for st in steps).to_dict(),
            "buckets": [int(r[0]["buckets"]) for r in per_rank]}


def build_records(suite: DpSuite, balances: dict[int, list[int]],
                  results: Sequence[tuple[Measured, dict[str, Any], dict[str, int]]] | None,
                  env: dict[str, Any], skipped: str | None = None) -> list[dict[str, Any]]:
    """One record per configuration, from every process's results (None: skipped, why)."""
    merged = merge_ranks([{0: r[0]} for r in results])[0] if results else None
    spec = get_model(suite.model)
    out = []
    for c in CONFIGS:
        record: dict[str, Any] = {
            "schema": SCHEMA, "id": f"{suite.model}/dp{c.dp}xpp{c.pp}/{c.kind}",
            "config": {"name": c.name, "model": suite.model, "dp": c.dp, "pp": c.pp,
                       "kind": c.kind, "global_batch": spec.batch_size, "device": suite.device,
                       "schedule": suite.schedule if c.kind == "pipe" else None,
                       "chunks": suite.chunks if c.kind == "pipe" else None,
                       "balance": balances[c.pp] if c.kind == "pipe" else None},
            "environment": env, "warmup": suite.warmup, "repeats": suite.repeats,
            "skipped": skipped, "step_time_s": None, "samples_per_s": None,
            "peak_stashed_bytes": [], "peak_stashed_microbatches": [], "param_bytes": [],
            "data_parallel": None}
        if merged is not None and results is not None:
            times = [s[1] - s[0] for s in merged.samples[c.name] if s is not None]
            step = summarize(times)
            record.update(step_time_s=step.to_dict(),
                          samples_per_s=step.inverse(spec.batch_size).to_dict(),
                          param_bytes=[r[2][c.name] for r in results],
                          **merged.memory[c.name])
            if c.kind == "pipe" and c.dp > 1:
                record["data_parallel"] = _hidden([r[1][c.name] for r in results])
        out.append(record)
    return out


def run_suite(suite: DpSuite, env: dict[str, Any], *, num_gpus: int = 0
              ) -> tuple[list[dict[str, Any]], list[str]]:
    """Spawn the processes, measure, and return the records and notes (what did not run)."""
    spec = get_model(suite.model)
    balances = {pp: balance_for(spec, "params", pp) for pp in {c.pp for c in CONFIGS}}
    notes: list[str] = []
    if suite.device == "cuda":
        group = Group(suite.model, "params", _NUM_PROCESSES, ("processes",), (suite.schedule,),
                      (suite.chunks,), suite.warmup, suite.repeats, suite.device)
        kept, notes = fit_to_gpus([group], num_gpus)
        if not kept:
            return build_records(suite, balances, None, env, skipped=notes[0]), notes
    gate = StartGate(mp.get_context("spawn"), _NUM_PROCESSES)
    results = spawn(run_rank, _NUM_PROCESSES, suite, balances, gate, timeout=7200.0,
                    backend="nccl" if suite.device == "cuda" else "gloo")
    return build_records(suite, balances, results, env), notes
