"""The `gpu` suite: one device, one process: the plain model, ours and torch's, side by side.

Every variant trains the same layers (a copy each, from one seed) on the same micro-batches,
timed step by step in turn, so each ratio is taken under the same conditions:

- `plain`: the model itself, accumulating the micro-batches' gradients (what Pipe must match);
- `ours p=k`: `Pipe` with k stages on the one device (threads; k = 1, 2, 4);
- `ours interleaved`: two stages on one rank, as torch's interleaved peer holds them;
- `torch 1f1b` / `torch interleaved`: torch.distributed.pipelining on a world of one (NCCL on
  a GPU, gloo on the CPU), one stage, or two under `ScheduleInterleaved1F1B`.

Two sizes: `launch`, where a step is kernel launches and the engine's own per-step and
per-action costs decide (four Linear(8)); `compute`, where kernels decide (16 x Linear(4096) in
bf16 on 16,384 rows). On the CPU the same code runs at sizes a CPU takes (its figures say
nothing about a GPU; the CPU run is how the suite is tested).
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.torch_baseline import TorchPipeline
from pipeline import Pipe
from pipeline.launch import host_store

__all__ = ["SIZES", "GpuSize", "render", "run_suite", "world_of_one"]


@dataclass(frozen=True)
class GpuSize:
    """A model of `depth` Linear(width) layers (ReLU between) on `rows` rows."""

    name: str
    width: int
    depth: int
    rows: int
    dtype: str  # a torch dtype's name


SIZES = {
    "cuda": (GpuSize("launch", 8, 4, 64, "float32"),
             GpuSize("compute", 4096, 16, 16384, "bfloat16")),
    "cpu": (GpuSize("launch", 8, 4, 64, "float32"),
            GpuSize("compute", 256, 8, 512, "float32")),
}
MICROBATCHES = (4, 8)


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A process group of this process alone while it lasts, unless one exists (torch's
    stages need one; ours run in threads under it, as a world of one is no pipeline of
    processes)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store, _ = host_store()  # on loopback alone
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layers(size: GpuSize, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(size.depth):
        layers.append(nn.Linear(size.width, size.width))
        if i < size.depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(device, getattr(torch, size.dtype))


def _halves(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def _variants(size: GpuSize, device: torch.device, m: int, pipes: list[Pipe]
              ) -> dict[str, Callable[[torch.Tensor, torch.Tensor], Any]]:
    """Each variant's step on a copy of the same layers (their gradients zeroed each step);
    the Pipes built go to `pipes`, for their caller to close."""
    base, loss_fn = _layers(size, device), nn.MSELoss()
    n = len(base)
    out: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {}

    plain = copy.deepcopy(base)

    def plain_step(x: torch.Tensor, y: torch.Tensor) -> None:
        plain.zero_grad(set_to_none=True)
        for xm, ym in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
            (loss_fn(plain(xm), ym) * (xm.shape[0] / x.shape[0])).backward()
    out["plain"] = plain_step

    def ours(balance: list[int], schedule: str, ranks: int) -> Callable[..., Any]:
        model = copy.deepcopy(base)
        pipe = Pipe(model, balance, devices=[device] * ranks, chunks=m, schedule=schedule,
                    checkpoint="never")
        pipes.append(pipe)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            model.zero_grad(set_to_none=True)
            pipe.step(x, y, loss_fn)
        return step
    for k in (1, 2, 4):
        out[f"ours p={k}"] = ours(_halves(n, k), "1f1b", k)
    out["ours interleaved"] = ours(_halves(n, 2), "interleaved", 1)

    def theirs(balance: list[int], schedule: str) -> Callable[..., Any]:
        model = copy.deepcopy(base)
        peer = TorchPipeline(model, balance, schedule=schedule, rank=0, num_ranks=1,
                             num_microbatches=m, loss_fn=loss_fn, device=device)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            model.zero_grad(set_to_none=True)
            peer.step(x, y)
        return step
    out["torch 1f1b"] = theirs([n], "1f1b")
    out["torch interleaved"] = theirs(_halves(n, 2), "interleaved")
    return out


def _timed(step: Callable[..., Any], x: torch.Tensor, y: torch.Tensor,
           device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a step's time is its GPU work's, whoever queued it
    return time.perf_counter() - start


def run_suite(device: torch.device, *, sizes: Sequence[GpuSize] | None = None,
              microbatches: Sequence[int] = MICROBATCHES, warmup: int = 3,
              repeats: int = 15) -> dict[str, Any]:
    """Median seconds per step of every variant at every size and micro-batch count."""
    rows = []
    with world_of_one(device):
        for size in sizes if sizes is not None else SIZES[device.type]:
            dtype = getattr(torch, size.dtype)
            torch.manual_seed(1)
            x = torch.randn(size.rows, size.width, dtype=dtype, device=device)
            y = torch.randn(size.rows, size.width, dtype=dtype, device=device)
            for m in microbatches:
                times = _measure(size, device, m, x, y, warmup, repeats)
                rows.append({"size": asdict(size), "microbatches": m,
                             "median_s": {k: statistics.median(v) for k, v in times.items()},
                             "seconds": times})
    return {"device": str(device), "rows": rows, "warmup": warmup, "repeats": repeats,
            "threads": torch.get_num_threads(), "pid_cpus": len(os.sched_getaffinity(0))}


def _measure(size: GpuSize, device: torch.device, m: int, x: torch.Tensor, y: torch.Tensor,
             warmup: int, repeats: int) -> dict[str, list[float]]:
    """Every variant's timed steps, one step of each per round, in turn: the same conditions."""
    pipes: list[Pipe] = []
    try:
        variants = _variants(size, device, m, pipes)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(warmup + repeats):
            for name, step in variants.items():
                took = _timed(step, x, y, device)
                if round_ >= warmup:
                    times[name].append(took)
        return times
    finally:
        for pipe in pipes:
            pipe.close()


def render(result: dict[str, Any], command: str, environment: str) -> str:
    """The report: medians, and ours against the plain model and against torch's."""
    lines = ["# One device: the plain model, ours and torch.distributed.pipelining", "",
             "## Result", "",
             "Median ms per step; ratios of medians, taken side by side (lower is faster).", "",
             "| size | m | plain | ours p=1 | ours p=2 | ours p=4 | torch 1f1b | ours interl. "
             "| torch interl. | p=1 / plain | p=1 / torch | interl. ours / torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        t = {k: v * 1e3 for k, v in row["median_s"].items()}
        size = row["size"]
        lines.append(
            f"| {size['name']} ({size['depth']} x {size['width']}, {size['rows']} rows, "
            f"{size['dtype']}) | {row['microbatches']} | {t['plain']:.2f} | "
            f"{t['ours p=1']:.2f} | {t['ours p=2']:.2f} | {t['ours p=4']:.2f} | "
            f"{t['torch 1f1b']:.2f} | {t['ours interleaved']:.2f} | "
            f"{t['torch interleaved']:.2f} | {t['ours p=1'] / t['plain']:.3f} | "
            f"{t['ours p=1'] / t['torch 1f1b']:.3f} | "
            f"{t['ours interleaved'] / t['torch interleaved']:.3f} |")
    lines += ["", "## Environment", "", f"{environment}; device {result['device']}; "
              f"{result['warmup']} warm-up and {result['repeats']} timed rounds, every "
              f"variant once per round in turn.", "", "## To reproduce", "",
              f"    {command}", ""]
    return "\n".join(lines)
