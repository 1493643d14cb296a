"""Running a schedule: one thread per rank in this process, or this process's rank of many."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from pipeline import multiprocess
from pipeline.distributed import DistributedTransport, PeerFailure
from pipeline.stage import StageRuntime, StepContext
from pipeline.transport import LocalTransport, PipelineAborted
from schedules import Action, Op, Schedule, Timeline

__all__ = ["Executor", "PipelineError"]


class PipelineError(RuntimeError):
    """A stage failed during a step; the message names its rank, stage, action and micro-batch."""


class Executor:
    """Runs validated schedules over a Pipe's stages and reports what ran."""

    def __init__(self, partitions: list[nn.Sequential], devices: list[torch.device],
                 world: tuple[int, int] | None, group: Any, timeout: float) -> None:
        self.partitions = partitions
        self.devices = devices
        self.world = world
        self.group = group
        self.timeout = timeout
        self._dist_transport: DistributedTransport | None = None

    def run(self, schedule: Schedule, ctx: StepContext, checkpoint: str
            ) -> tuple[Timeline, list[dict[str, int]]]:
        """Execute `schedule`; return the measured timeline and per-rank memory statistics."""
        runtimes = self._run_rank(schedule, ctx) if self.world else self._run_threads(schedule, ctx)
        timeline = Timeline(
            schedule.num_ranks, tuple(e for rt in runtimes for e in rt.events), "s",
            {"schedule": schedule.name, "num_ranks": schedule.num_ranks,
             "num_stages": schedule.num_stages, "num_microbatches": schedule.num_microbatches,
             "devices": [str(d) for d in self.devices], "checkpoint": checkpoint})
        stats = [{"peak_stashed_microbatches": rt.peak_stashed,
                  "peak_stashed_bytes": rt.peak_stashed_bytes} for rt in runtimes]
        return timeline, stats

    def share(self, values: torch.Tensor | None, shape: tuple[int, ...],
              src: int) -> torch.Tensor | None:
        """`values` from rank `src` to every rank (multi-process); as is in one process."""
        if not self.world:
            return values
        try:
            return multiprocess.share(self.transport(), values, src, self.world[1], shape)
        except (PipelineAborted, PeerFailure) as exc:
            raise PipelineError(str(exc)) from None

    def _runtime(self, rank: int, schedule: Schedule, transport: Any) -> StageRuntime:
        return StageRuntime(rank, {s: self.partitions[s] for s in schedule.stages_of(rank)},
                            self.devices[rank], schedule.num_stages, schedule.rank_of, transport)

    def _failure(self, rank: int, action: Action | None, exc: BaseException) -> str:
        where = "before its first action" if action is None else (
            f"at {action} ({_describe(action)})")
        return f"rank {rank} ({self.devices[rank]}) failed {where}: {type(exc).__name__}: {exc}"

    def _run_threads(self, schedule: Schedule, ctx: StepContext) -> list[StageRuntime]:
        transport = LocalTransport(self.timeout)
        runtimes = [self._runtime(r, schedule, transport) for r in range(schedule.num_ranks)]
        failures: list[tuple[int, Action | None, BaseException]] = []

        def work(rt: StageRuntime) -> None:
            try:
                if rt.device.type == "cuda":
                    torch.cuda.set_device(rt.device)
                rt.run(schedule.actions[rt.rank], ctx)
            except PipelineAborted:
                pass  # another rank failed first; its error is the one to report
            except BaseException as exc:
                failures.append((rt.rank, rt.current, exc))
                transport.abort(rt.rank, f"rank {rt.rank} failed")

        if len(runtimes) == 1:
            work(runtimes[0])
        else:
            threads = [threading.Thread(target=work, args=(rt,), name=f"pipe-rank-{rt.rank}",
                                        daemon=True) for rt in runtimes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if failures:
            rank, action, exc = failures[0]
            raise PipelineError(self._failure(rank, action, exc)) from exc
        return runtimes

    def transport(self) -> DistributedTransport:
        # One per Pipe: the shapes agreed with each peer carry over from step to step.
        if self._dist_transport is None:
            assert self.world is not None
            self._dist_transport = DistributedTransport(
                self.world[0], self.devices[self.world[0]], timeout=self.timeout,
                group=self.group)
        return self._dist_transport

    def _run_rank(self, schedule: Schedule, ctx: StepContext) -> list[StageRuntime]:
        assert self.world is not None
        rank = self.world[0]
        transport = self.transport()
        transport.begin(schedule)
        rt = self._runtime(rank, schedule, transport)
        try:
            if rt.device.type == "cuda":
                torch.cuda.set_device(rt.device)
            rt.run(schedule.actions[rank], ctx)
            transport.finish()
        except PipelineAborted as exc:  # another rank failed and said so
            raise PipelineError(str(exc)) from None
        except PeerFailure as exc:  # another rank died
            transport.abort(rank, str(exc))
            raise PipelineError(str(exc)) from exc
        except BaseException as exc:
            message = self._failure(rank, rt.current, exc)
            transport.abort(rank, message)
            raise PipelineError(message) from exc
        return [rt]


def _describe(action: Action) -> str:
    what = {Op.F: "forward", Op.B: "backward", Op.I: "input-gradient backward",
            Op.W: "weight-gradient backward", Op.U: "weight update"}.get(action.op, action.op.value)
    unit = "batch" if action.op is Op.U else "micro-batch"
    return f"{what} of stage {action.stage}, {unit} {action.microbatch}"

