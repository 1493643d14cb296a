"""torch.distributed.pipelining's own schedule classes, built without a process group, and the
CSVs they write: the reference our CSV reader and writer are tested against."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace
from typing import Any

from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

from benchmarks.torch_baseline import peer_stages

__all__ = ["TORCH_CLASSES", "build", "rank_stages", "torch_csv", "unsupported"]

# Every schedule class torch 2.13 has for training.
TORCH_CLASSES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def _cls(name: str) -> Any:
    return getattr(torch_schedules, name)


def rank_stages(name: str, num_ranks: int, rank: int, stages_per_rank: int | None = None
                ) -> list[int]:
    """The stages `rank` holds under torch's class `name` (by default two per rank for the
    multi-stage classes, one for the single-stage ones)."""
    multi = issubclass(_cls(name), torch_schedules.PipelineScheduleMulti)
    k = stages_per_rank or (2 if multi else 1)
    return peer_stages(name, rank, num_ranks, num_ranks * k)


def unsupported(name: str, num_ranks: int, num_microbatches: int) -> str | None:
    """Why torch's class `name` refuses (p, m), in torch's own words (None: it accepts them)."""
    try:
        build(name, num_ranks, num_microbatches)
    except ValueError as exc:
        return f"{name} refuses p={num_ranks} m={num_microbatches}: {exc}"
    return None


def build(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
          ) -> Any:
    """Torch's schedule object for p ranks and m micro-batches, on stand-in stages.

    The classes compute every rank's `pipeline_order` in their constructor from the stages'
    counts alone (group size, rank, stage indices), so stand-ins with those fields are enough:
    the order is torch's own code's, no process group needed.
    """
    p, cls = num_ranks, _cls(name)
    stages = rank_stages(name, p, 0, stages_per_rank)
    num_stages = p * len(stages)
    fakes = [SimpleNamespace(num_stages=num_stages, group_size=p, group_rank=0, stage_index=s,
                             submod=nn.Identity()) for s in stages]
    if issubclass(cls, torch_schedules.PipelineScheduleMulti):
        return cls(fakes, n_microbatches=num_microbatches)
    return cls(fakes[0], n_microbatches=num_microbatches)


def torch_csv(name: str, num_ranks: int, num_microbatches: int, *, comms: bool,
              stages_per_rank: int | None = None) -> str:
    """The CSV torch's own `_dump_csv` writes for its class `name`: compute-only (its
    `pipeline_order`, idle steps as empty cells) or, for the runtime classes, with communication
    (`pipeline_order_with_comms`: SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD and DualPipeV's
    OVERLAP_F_B cells). The multi-stage classes take `stages_per_rank` (default two)."""
    sched = build(name, num_ranks, num_microbatches, stages_per_rank)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "torch.csv")
        if comms:
            torch_schedules._PipelineScheduleRuntime._dump_csv(sched, path, format="compute_comms")
        else:  # the single-stage classes have no writer of their own: the base class's
            torch_schedules.PipelineScheduleMulti._dump_csv(sched, path)
        with open(path, newline="") as f:
            return f.read()
