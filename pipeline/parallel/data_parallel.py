"""Pipeline x data parallelism: replicas of one pipeline along a DeviceMesh's "dp" dimension.

Each replica runs the whole pipeline on its own shard of the global batch. Loss weights use the
global batch's rows (the replicas exchange their row counts), and each stage's gradients are
averaged over "dp" in buckets, asynchronously, from the stage's REDUCE_GRAD, which the step's
program places right after its last gradient action (B, W, or 2BW's U): the reduction of the
last stage overlaps the backwards still running on earlier stages, and the step waits for all
of them only at its end (AWAIT_GRAD).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.comm.handed import Handed, handed
from pipeline.errors import PipeConfigError, PipelineError
from pipeline.parallel.mesh import Mesh
from pipeline.parallel.tensor_parallel import grads_as_params, like_param, local_tensor

__all__ = ["SHARDING", "GradSync", "Replicas"]

SHARDING = ("replicate", "fsdp")

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: torch.Tensor  # the gradients (zeros where a replica has none), then one flag each
    held: Handed  # `flat`, until the backend lets go of it
    work: Any
    launched: float
    done: list[float]


class GradSync:
    """Averages the gradients of this rank's stages over the "dp" group, one stage at a time.

    `stage_done(s)` launches the all-reduces of stage s's gradients (flattened into buckets of
    at most `BUCKET_BYTES`); `finish()` waits for them, writes the averages back into `.grad`,
    and records how much of the reduction the pipeline hid (`stats`).

    Each bucket ends with one presence flag per parameter (1 where this replica has a
    gradient), summed with the gradients, so the replicas agree on which parameters have one:
    a parameter no replica produced a gradient for keeps `.grad` None (an optimizer skips it,
    as on one device and under DDP's `find_unused_parameters`); one that some replicas did not
    use gets the average with zeros for them.
    """

    def __init__(self, stages: dict[int, nn.Module], group: Any,
                 wait: Callable[[Any, str], None]) -> None:
        self.stages = stages
        self.group = group
        self._wait = wait
        self._buckets: list[_Bucket] = []
        self.stats: dict[str, float] = {}

    def stage_done(self, stage: int) -> None:
        params = [p for p in self.stages[stage].parameters() if p.requires_grad]
        grads_as_params(params)  # under tp: partial sums reduced first (every replica alike)
        for chunk in _chunks(params):
            # Under tp, each replica reduces its own shards (its dp group shares its tp rank).
            numel = sum(local_tensor(p).numel() for p in chunk)
            flat = local_tensor(chunk[0]).new_zeros(numel + len(chunk))  # same on every replica
            offset = 0
            for i, p in enumerate(chunk):
                n = local_tensor(p).numel()
                if p.grad is not None:
                    flat[offset:offset + n].copy_(local_tensor(p.grad).reshape(-1))
                    flat[numel + i] = 1
                offset += n
            flat[:numel].div_(dist.get_world_size(self.group))
            # Launched before the call: gloo may finish (and stamp `done`) before it returns,
            # and a launch stamped after its end made a negative span.
            held = Handed([flat])
            launched = time.perf_counter()
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            done: list[float] = []
            work.get_future().then(lambda _f, done=done: done.append(time.perf_counter()))
            self._buckets.append(_Bucket(chunk, flat, held, work, launched, done))

    def finish(self) -> None:
        """Wait for every reduction of the step and write the averages into `.grad`."""
        start = time.perf_counter()
        try:
            for bucket in self._buckets:
                self._wait(bucket.work, "the gradient all-reduce over dp")
                bucket.work = None
                bucket.held.settle()  # see pipeline/comm/handed.py
                numel = bucket.flat.numel() - len(bucket.params)
                present = (bucket.flat[numel:] > 0).tolist()
                offset = 0
                for p, anywhere in zip(bucket.params, present, strict=True):
                    shard = local_tensor(p)
                    average = bucket.flat[offset:offset + shard.numel()].view_as(shard)
                    offset += shard.numel()
                    if not anywhere:
                        continue  # no replica has a gradient: None stays None
                    if p.grad is None:
                        p.grad = like_param(p, average.clone())
                    else:
                        local_tensor(p.grad).copy_(average)
            end = time.perf_counter()
            spans = [(b.launched, b.done[0] if b.done else end) for b in self._buckets]
            busy = _union(spans)
            exposed = _union([(max(a, start), b) for a, b in spans if b > start])
            self.stats = {"allreduce_s": busy, "exposed_s": exposed,
                          "hidden_share": 1.0 - exposed / busy if busy > 0 else 1.0,
                          "buckets": float(len(self._buckets))}
        finally:
            self._buckets.clear()

    def abandon(self) -> None:
        self._buckets.clear()


def _chunks(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters in order, grouped into buckets of one dtype and device, at most
    `BUCKET_BYTES` each (one parameter larger than that is a bucket of its own)."""
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = local_tensor(p).numel() * p.element_size()
        if (not out or size + nbytes > BUCKET_BYTES or out[-1][0].dtype != p.dtype
                or out[-1][0].device != p.device):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of time intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class Replicas:
    """This rank's view of the other replicas of its stages (its "dp" group): agreement on the
    configuration, the global batch's rows, the global loss, the gradient averaging, and the
    buffers (dp rank 0's, at construction and after each step, as DDP's `broadcast_buffers`).
    Everything but the gradients and buffers travels point to point; every wait is the
    transport's failure-aware one, so a replica that failed is named rather than waited for."""

    def __init__(self, mesh: Mesh, stages: dict[int, nn.Module], device: torch.device,
                 timeout: float, shard: str, *, broadcast_buffers: bool = True) -> None:
        from pipeline.comm.process_group import ProcessTransport

        self.mesh = mesh
        self.shard = shard
        self.broadcast_buffers = broadcast_buffers
        self.transport = ProcessTransport(mesh.dp_rank, device, timeout=timeout,
                                              group=mesh.dp, watch=mesh.ranks,
                                              names=mesh.dp_peer)
        self.sync = GradSync(stages, mesh.dp, self.transport.wait_work)
        self._stages = stages
        with self._named_failures():  # replicas start alike, as DDP makes them
            self._broadcast(self._local_buffers(), "the buffers' broadcast from dp rank 0")
        if shard == "fsdp":  # FSDP2 shards each stage and reduce-scatters its gradients
            from torch.distributed.fsdp import fully_shard

            for module in stages.values():
                # Kept unsharded between forward and backward, as torchtitan does for
                # pipelines: a stage runs several forwards before their backwards.
                fully_shard(module, mesh=mesh.dp_mesh, reshard_after_forward=False)
        self._agreed: set[str] = set()

    @property
    def grads_ready(self) -> Callable[[int], None] | None:
        return self.sync.stage_done if self.shard == "replicate" else None

    def agree(self, pipe: Any, num_batches: int) -> None:
        """The replicas were built and called alike (once per new combination)."""
        with self._named_failures():
            self._agree(pipe, num_batches)

    def _agree(self, pipe: Any, num_batches: int) -> None:
        mine = json.dumps({"mesh": [self.mesh.dp_size, self.mesh.pp_size, self.mesh.tp_size],
                           "balance": pipe.balance, "schedule": str(pipe._probe.name),
                           "chunks": pipe.chunks, "checkpoint": pipe.checkpoint,
                           "batches per call": num_batches}, sort_keys=True)
        if mine in self._agreed:
            return
        seen = self.transport.exchange(mine)
        if len(set(seen)) > 1:
            values = "; ".join(f"dp rank {r}: {v}" for r, v in enumerate(seen))
            raise PipeConfigError(
                f"the replicas (dp ranks at pp {self.mesh.pp_rank}) disagree on their "
                f"configuration: {values}. Every rank must build Pipe with the same mesh "
                f"shape, balance, schedule, chunks and checkpoint, and call it alike")
        self._agreed.add(mine)

    def global_total(self, total: float) -> float:
        """The sum over every replica's shard of what the loss averages over (rows, counted
        tokens), exchanged exactly (every replica gets the same, correctly rounded)."""
        with self._named_failures():
            return math.fsum(float.fromhex(v) for v in self.transport.exchange(
                float(total).hex()))

    def mean(self, losses: torch.Tensor) -> torch.Tensor:
        """The replicas' losses (each weighted by the global rows, times dp) averaged."""
        payload = ",".join(float(v).hex() for v in losses.tolist())
        with self._named_failures():
            seen = self.transport.exchange(payload)
        parts = [[float.fromhex(v) for v in p.split(",")] for p in seen]
        total = torch.tensor(parts, dtype=torch.float64).sum(0) / self.mesh.dp_size
        return total.to(losses.dtype).to(losses.device)

    def weighting(self, total: float) -> tuple[float, float]:
        """Loss weights over the global batch, times dp: averaging the gradients over the
        replicas then gives the global batch's (a mean over all of it, or a sum)."""
        return self.global_total(total), float(self.mesh.dp_size)

    def wait_grads(self) -> None:
        """The rank's AWAIT_GRAD: the gradients' averages (nothing to wait for under FSDP2:
        it reduced in the backward)."""
        with self._named_failures():
            self.sync.finish()

    def finish(self) -> None:
        """After a training step's run (and deferred BatchNorm's commit): unless
        `broadcast_buffers=False`, every replica takes dp rank 0's buffers."""
        with self._named_failures():
            if self.broadcast_buffers:
                self._broadcast(self._local_buffers(), "the buffers' broadcast from dp rank 0")

    def all_reduce(self, flat: torch.Tensor, what: str) -> None:
        """Sum `flat` over the replicas, in place (deferred BatchNorm's global statistics)."""
        with self._named_failures(), handed(flat):
            work = dist.all_reduce(flat, group=self.mesh.dp, async_op=True)
            self.transport.wait_work(work, what)
            del work  # the backend's reference is the last one `handed` waits for

    def _local_buffers(self) -> list[torch.Tensor]:
        """Every buffer of this rank's stages, in the same order on every replica."""
        return [b for s in sorted(self._stages) for b in self._stages[s].buffers()]

    def _broadcast(self, tensors: list[torch.Tensor], what: str) -> None:
        """dp rank 0's values of `tensors` to every replica: one broadcast per dtype and
        device, each of every such tensor flattened into one."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for same in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            with handed(flat):
                work = dist.broadcast(flat, group=self.mesh.dp, group_src=0, async_op=True)
                self.transport.wait_work(work, what)
                del work  # the backend's reference is the last one `handed` waits for
            if self.mesh.dp_rank != 0:
                with torch.no_grad():
                    offset = 0
                    for t in same:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

    @contextmanager
    def _named_failures(self) -> Iterator[None]:
        """Failures seen while talking to the replicas, as `PipelineError`s; a replica found
        dead is reported to every rank of the mesh."""
        from pipeline.comm.process_group import PeerFailure
        from pipeline.comm.transport import PeerTimeout, PipelineAborted

        try:
            yield
        except PipelineAborted as exc:
            raise PipelineError(str(exc)) from None
        except (PeerFailure, PeerTimeout) as exc:
            self.transport.abort(self.mesh.dp_rank, str(exc))
            raise PipelineError(str(exc)) from None

    def abandon(self, exc: BaseException) -> None:
        """A step failed here: forget its reductions and wake the replicas waiting on us."""
        self.sync.abandon()
        self.transport.abort(self.mesh.dp_rank, str(exc), report=False)  # reported already
