"""Running lowered schedules: persistent rank workers in this process, or this process's rank."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pipeline.comm import collectives
from pipeline.comm.failures import PeerTimeout, PipelineAborted
from pipeline.comm.process_group import PeerFailure, ProcessTransport
from pipeline.comm.threads import ThreadTransport
from pipeline.errors import PipelineError
from pipeline.parallel.mesh import Mesh
from pipeline.runtime.stage import StageRuntime, StepInputs, StepResult
from pipeline.runtime.workers import RankWorkers
from schedules import SYNC_OPS, Action, Op, Schedule, Timeline
from schedules.validate_syncs import describe_sync

__all__ = ["Executor"]

_log = logging.getLogger(__name__)


class _Stalled(Exception):
    """A rank's action ran longer than the timeout while nothing else failed."""


class Executor:
    """Runs lowered schedules over a Pipe's stages and reports what ran.

    Built once per Pipe: the stage runtimes, the transport and (with several ranks in one
    process) the rank worker threads live as long as the Pipe and serve every step.
    """

    def __init__(self, partitions: list[nn.Module], devices: list[torch.device],
                 placement: Schedule, world: tuple[int, int] | None, group: Any,
                 timeout: float, mesh: Mesh | None = None) -> None:
        self.devices = devices
        self.world = world
        self.timeout = timeout
        self.broken: str | None = None
        self._mesh = mesh
        self._rank_of = placement.rank_of
        self._placement = placement.placement
        self.transport: ThreadTransport | ProcessTransport
        if world is not None:
            self.transport = ProcessTransport(world[0], devices[world[0]], timeout=timeout,
                                                  group=group,
                                                  watch=mesh.ranks if mesh is not None else None,
                                                  names=mesh.pp_peer if mesh is not None else None)
            ranks = [world[0]]
        else:
            self.transport = ThreadTransport(timeout)
            ranks = list(range(placement.num_ranks))
        self.runtimes = [StageRuntime(r, {s: partitions[s] for s in placement.stages_of(r)},
                                      devices[r], placement.num_stages, placement.rank_of,
                                      self.transport) for r in ranks]
        # The last step's phases around its actions, (start, end) in `time.perf_counter()`:
        # "begin" (posting receives), "finish" (its sends completed), "share" (the loss to
        # every rank); for its anatomy (benchmarks/anatomy.py).
        self.phases: dict[str, tuple[float, float]] = {}
        self.workers: RankWorkers | None = None
        if world is None and len(ranks) > 1:
            self.workers = RankWorkers(devices)
            weakref.finalize(self, self.workers.close)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
        self.transport.close()

    def run(self, schedule: Schedule, step: StepInputs, result: StepResult, checkpoint: str
            ) -> tuple[Callable[[], Timeline], list[dict[str, int]]]:
        """Execute the lowered `schedule`; return the measured timeline (a function making it
        when first called: on a GPU that reads the CUDA events, after the step) and per-rank
        memory."""
        if self.broken is not None:
            raise PipelineError(self.broken)
        self.transport.check_usable()  # after a failure, messages of it may be in flight
        if schedule.placement != self._placement:
            raise AssertionError("the executor runs lowered schedules of its own placement")
        self.phases = {}
        if self.world is not None:
            self._run_rank(schedule, step, result)
        else:
            with self._phase("begin"):
                self.transport.begin(schedule)
            self._run_threads(schedule, step, result)
        meta = {"schedule": schedule.name, "num_ranks": schedule.num_ranks,
                **({"syncs": str(schedule.syncs)} if schedule.syncs is not None else {}),
                "num_stages": schedule.num_stages, "num_microbatches": schedule.num_microbatches,
                "devices": [str(d) for d in self.devices], "checkpoint": checkpoint,
                "t0": step.t0}  # time.perf_counter() at the step's start: events count from it
        ran = [(rt, rt.events, rt.pending) for rt in self.runtimes]
        made: list[Timeline] = []

        def timeline() -> Timeline:
            if not made:
                events = []
                for rt, host, pending in ran:
                    timed = host if pending is None else pending()
                    if rt.events is host:  # still the rank's last run: it shows these times
                        rt.events, rt.pending = timed, None
                    events.extend(timed)
                made.append(Timeline(schedule.num_ranks, tuple(events), "s", meta))
            return made[0]
        stats = [{"peak_stashed_microbatches": rt.peak_stashed,
                  "peak_stashed_bytes": rt.peak_stashed_bytes,
                  "peak_activation_bytes": rt.peak_activation_bytes,
                  "released_output_bytes": rt.released_bytes} for rt in self.runtimes]
        return timeline, stats

    @property
    def exchange(self) -> Callable[[str], list[str]] | None:
        """Every rank's text, in rank order (`ProcessTransport.exchange`); None in one
        process, where nothing needs exchanging."""
        if self.world is None:
            return None
        assert isinstance(self.transport, ProcessTransport)
        return self.transport.exchange

    def share(self, values: torch.Tensor | None, shape: tuple[int, ...],
              src: int) -> torch.Tensor | None:
        """`values` from rank `src` to every rank (multi-process); as is in one process."""
        if self.world is None:
            return values
        assert isinstance(self.transport, ProcessTransport)
        try:
            with self._phase("share"):
                return collectives.share(self.transport, values, src, self.world[1], shape)
        except (PipelineAborted, PeerFailure) as exc:
            raise PipelineError(str(exc)) from None

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.phases[name] = (start, time.perf_counter())

    def _who(self, rank: int) -> str:
        """A rank and its device, with its place in the mesh under data parallelism."""
        where = "" if self._mesh is None else self._mesh.pp_peer(rank).partition(" (")[2][:-1]
        return f"rank {rank} ({self.devices[rank]}{'; ' + where if where else ''})"

    def _failure(self, rank: int, action: Action | None, exc: BaseException) -> str:
        where = "before its first action" if action is None else (
            f"at {action} ({_describe(action)})")
        advice = "raise Pipe(timeout=...) if a stage is really that slow"
        if isinstance(exc, _Stalled):
            return (f"{self._who(rank)} is stuck {where}: that action ran for "
                    f"more than timeout={self.timeout:g}s; {advice}")
        if isinstance(exc, PeerTimeout):  # blame the rank that did not deliver, not the waiter
            current = self.runtimes[exc.src].current if self.world is None else None
            at = "" if current is None else f" at {current} ({_describe(current)})"
            return (f"{self._who(exc.src)} is stuck{at} (or too slow): rank "
                    f"{rank} waited {exc.seconds:g}s {where} for {exc.what} from it; {advice}")
        return f"{self._who(rank)} failed {where}: {type(exc).__name__}: {exc}"

    def _stalled(self, failures: list[tuple[int, Action | None, BaseException]],
                 seen: dict[int, tuple[Action, float]]) -> bool:
        """Whether the step has failed, noting as a failure a rank whose action (other than a
        wait for a peer, which times out by itself) has run longer than the timeout."""
        if failures:
            return True
        assert isinstance(self.transport, ThreadTransport)
        now = time.monotonic()
        waiting = {self._rank_of(msg[1]) for msg in self.transport.waiting_now()}
        for rt in self.runtimes:
            action = rt.current
            if action is None:  # not started, or done
                continue
            first = seen.get(rt.rank)
            if first is None or first[0] is not action or rt.rank in waiting:
                seen[rt.rank] = (action, now)
            elif now - first[1] > self.timeout:
                failures.append((rt.rank, action, _Stalled()))
                self.transport.abort(rt.rank, f"rank {rt.rank} is stuck at {action}")
                return True
        return False

    def _run_threads(self, schedule: Schedule, step: StepInputs, result: StepResult) -> None:
        transport = self.transport
        failures: list[tuple[int, Action | None, BaseException]] = []

        def job(rt: StageRuntime) -> None:
            try:
                rt.run(schedule.actions[rt.rank], step, result)
            except PipelineAborted:
                pass  # another rank failed first; its error is the one to report
            except BaseException as exc:
                failures.append((rt.rank, rt.current, exc))
                transport.abort(rt.rank, f"rank {rt.rank} failed")

        if self.workers is None:
            job(self.runtimes[0])
        else:
            seen: dict[int, tuple[Action, float]] = {}
            stuck = self.workers.run([functools.partial(job, rt) for rt in self.runtimes],
                                     failed=lambda: self._stalled(failures, seen),
                                     grace=min(self.timeout, 5.0))
            if stuck:
                _log.warning("abandoning the threads of rank(s) %s after a failure", stuck)
                self.broken = (
                    f"rank(s) {stuck} did not stop within {min(self.timeout, 5.0):g}s of a "
                    f"failure elsewhere (still at " + ", ".join(
                        str(self.runtimes[r].current) for r in stuck)
                    + "); their threads are abandoned and this Pipe cannot run another step: "
                    "build a new one")
                self.workers.close(wait=False)
                self.workers = None
        if failures:
            rank, action, exc = failures[0]
            message = self._failure(rank, action, exc)
            _log.info("step failed: %s", message)
            if self.broken is not None:
                message += f"\n{self.broken}"
            raise PipelineError(message) from exc

    def _run_rank(self, schedule: Schedule, step: StepInputs, result: StepResult) -> None:
        assert self.world is not None
        rank, rt, transport = self.world[0], self.runtimes[0], self.transport
        try:
            with self._phase("begin"):  # posts receives: a peer that died already fails here
                transport.begin(schedule)
            rt.run(schedule.actions[rank], step, result)
            with self._phase("finish"):
                transport.finish()
        except PipelineAborted as exc:  # another rank failed and said so
            _log.info("rank %d: step aborted: %s", rank, exc)
            raise PipelineError(str(exc)) from None
        except PeerFailure as exc:  # another rank died
            _log.warning("rank %d: %s", rank, exc)
            transport.abort(rank, str(exc))
            raise PipelineError(str(exc)) from exc
        except BaseException as exc:
            try:  # a collective inside a stage (tp) breaks when a peer that failed exits:
                assert isinstance(transport, ProcessTransport)
                transport.check_failed()  # that peer's report is the failure to name
            except PipelineAborted as first:
                _log.info("rank %d: step aborted: %s", rank, first)
                raise PipelineError(str(first)) from exc
            except PeerFailure:  # the store is gone too: this rank's own error says most
                pass
            message = self._failure(rank, rt.current, exc)
            _log.warning("%s", message)
            transport.abort(rank, message)
            raise PipelineError(message) from exc


def _describe(action: Action) -> str:
    if action.op in SYNC_OPS:
        return describe_sync(action)
    what = {Op.F: "forward", Op.B: "backward", Op.I: "input-gradient backward",
            Op.W: "weight-gradient backward", Op.U: "weight update"}.get(action.op, action.op.value)
    unit = "batch" if action.op is Op.U else "micro-batch"
    return f"{what} of stage {action.stage}, {unit} {action.microbatch}"
