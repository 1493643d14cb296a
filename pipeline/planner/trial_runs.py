"""The trials' runtime: each turn a `Pipe` on a copy of the model, timed, on threads or ranks.

Threads: this process's ranks; processes: every rank of the launched group takes each turn."""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from pipeline.comm.handed import handed
from pipeline.errors import PipeConfigError
from pipeline.planner.costs import LossFn
from pipeline.planner.result import Plan
from pipeline.planner.space import Candidate
from pipeline.planner.time_model import compute_spans
from pipeline.planner.trials import chosen_as
from schedules import Action, Event, Timeline

__all__ = ["Runner", "check_launch", "rows_of"]


def check_launch(transport: str, ranks: int) -> None:
    """Trials over processes need this process to be one of the launched group's `ranks`."""
    if transport == "threads":
        return
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if world != ranks:
        got = "no process group" if world is None else f"a group of {world} ranks"
        raise PipeConfigError(
            f"trials over transport={transport!r} run the candidates on the launched ranks, "
            f"so plan(..., trials=k) must be called on every rank of a process group of "
            f"ranks={ranks} (torch.distributed initialised, e.g. under python -m "
            f"pipeline.launch --nproc {ranks}); found {got}. Launch it so, or plan with "
            f"trials=0 (by prediction alone), or with transport='threads' to measure threads "
            f"of this process")


def rows_of(value: Any, batch: int, index: int, parts: int) -> Any:
    """Replica `index` of `parts`: each tensor whose first dimension is the batch's rows, cut."""
    size = batch // parts

    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            return v[index * size:(index + 1) * size]
        return v

    return tree_map(cut, value)


class Runner:
    """Takes the trials' turns for one plan: `turn` builds the candidate's Pipe on a deep copy
    of the model, steps it, and returns the timed steps' seconds."""

    def __init__(self, p: Plan, model: nn.Module, sample: Any, target: Any, loss_fn: LossFn,
                 transport: str) -> None:
        self.p, self.model, self.loss_fn = p, model, loss_fn
        self.sample, self.target = sample, target
        self.ranks = len(p.memory_per_rank)
        self.processes = transport != "threads"
        self.cuda = transport == "nccl" or any(str(d).startswith("cuda")
                                               for d in p.devices or ())
        self.meshes: dict[tuple[int, int, int], Any] = {}
        # Per turn without tp, each timed step's events on this process's ranks (and, under
        # dp, the replica they belong to), on the clock every process shares: the time
        # model's measurements.
        self.events: list[tuple[Candidate, float, int,
                                list[tuple[int, str, float, float]]]] = []
        check_launch(transport, self.ranks)

    def agree(self, chosen: list[Candidate]) -> list[Candidate]:
        """Every rank runs rank 0's candidates (each rank's own measurements may have ordered
        its candidates otherwise), and has the meshes they need, made in the same order."""
        if not self.processes:
            return chosen
        box: list[Any] = [chosen]
        dist.broadcast_object_list(box, src=0)
        chosen = list(box[0])
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if self.cuda else "cpu"
        for dp, pp, tp in sorted({(c.dp, c.pp, c.tp) for c in chosen if c.dp > 1 or c.tp > 1}):
            self.meshes[dp, pp, tp] = (
                init_device_mesh(device, (dp, pp), mesh_dim_names=("dp", "pp")) if tp == 1 else
                init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp")))
        return chosen

    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        """The trials' steps draw random numbers (each step's seed, dropout): the caller's
        generators are as they were afterwards. What lives before the trials is frozen out of
        the garbage collector meanwhile, so that collecting each turn's garbage (before its
        timed steps) stays short: a full collection over torch's objects takes longer than a
        small model's whole turn."""
        cuda = list(range(torch.cuda.device_count())) if self.cuda else []
        gc.collect()
        gc.freeze()
        try:
            with torch.random.fork_rng(devices=cuda):
                yield
        finally:
            gc.unfreeze()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def turn(self, c: Candidate, warmup: int, steps: int) -> list[float] | str:
        """One turn of `c`: a fresh Pipe on a copy of the model, `warmup` steps, then `steps`
        timed ones (a barrier before each, with processes); their seconds. When a step fails
        on any rank (out of memory, a stage's error: every rank's step raises), the failure,
        the same on every rank, in place of the seconds."""
        kept = len(self.events)
        failed: str | None = None
        try:
            out = self._turn(c, warmup, steps)
        except RuntimeError as exc:  # PipelineError, torch.OutOfMemoryError among them
            out, failed = [], f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        if self.processes:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, failed)
            # A PipelineError names the rank that failed; another error, the rank it rose on.
            failed = next((f if f.startswith("PipelineError") else f"rank {r}: {f}"
                           for r, f in enumerate(every) if f is not None), None)
        if failed is not None:
            del self.events[kept:]  # a failed candidate's steps fit nothing
            return failed
        return out

    def _turn(self, c: Candidate, warmup: int, steps: int) -> list[float]:
        from pipeline import pipe as pipe_module  # looked up at each turn: tests replace it

        extra: dict[str, Any] = {}
        x, y = self.sample, self.target
        mesh = self.meshes.get((c.dp, c.pp, c.tp))
        replica = 0  # this process's replica under dp
        if mesh is not None:
            extra["mesh"] = mesh
            if c.dp > 1:
                batch, replica = self.p.profile.batch_rows, mesh.get_local_rank("dp")
                x, y = (rows_of(v, batch, replica, c.dp) for v in (x, y))
        kwargs = chosen_as(self.p, c).pipe_kwargs(**extra)
        model = copy.deepcopy(self.model)  # the caller's weights and gradients stay untouched
        model.zero_grad(set_to_none=True)
        pipe = pipe_module.Pipe(model, **kwargs)
        try:
            for _ in range(warmup):
                model.zero_grad(set_to_none=True)
                pipe.step(x, y, self.loss_fn)
            self._sync()
            # The last turn's garbage goes now, not inside a timed step, and no collection
            # lands in one candidate's step alone.
            gc.collect()
            out = []
            gc.disable()
            try:
                for _ in range(steps):
                    model.zero_grad(set_to_none=True)
                    if self.processes:
                        dist.barrier()
                    start = time.perf_counter()
                    pipe.step(x, y, self.loss_fn)
                    self._sync()
                    out.append(time.perf_counter() - start)
                    if c.tp == 1:
                        timeline = pipe.last_timeline()
                        t0 = float(timeline.meta["t0"])
                        self.events.append((c, out[-1], replica, [
                            (e.rank, str(e.action), t0 + e.start, t0 + e.end)
                            for e in timeline.events]))
            finally:
                gc.enable()
        finally:
            pipe.close()
        return out

    def shared(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (each rank profiled the model itself, so what it
        derives from its own profile may differ)."""
        if not self.processes:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def timelines(self) -> list[tuple[Candidate, float, Timeline, tuple[tuple[float, float],
                                                                        ...]]]:
        """Every timed step without tp: its candidate, seconds, measured timeline (the first
        replica's ranks; with processes, every rank's events gathered, the step the slowest
        rank's) and the other replicas' compute, (start, end) on that timeline's clock."""
        steps = [(c, s, [(d, *e) for e in events]) for c, s, d, events in self.events]
        if self.processes:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, [(s, e) for _, s, e in steps])
            steps = [(c, max(p[i][0] for p in every), [e for p in every for e in p[i][1]])
                     for i, (c, _, _) in enumerate(steps)]
        out = []
        for c, seconds, events in steps:
            start = min(e[3] for e in events if e[0] == 0)
            laid = tuple(Event(r, Action.parse(a), s - start, e - start)
                         for d, r, a, s, e in events if d == 0)
            beside = compute_spans((e[1:] for e in events if e[0] != 0), start)
            out.append((c, seconds, Timeline(c.pp, laid, "s"), beside))
        return out

    def slowest(self, times: list[list[list[float]]]) -> list[list[list[float]]]:
        """Each step's seconds on the slowest rank (every rank then chooses alike)."""
        if not self.processes:
            return times
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else "cpu"
        t = torch.tensor(times, dtype=torch.float64, device=device)
        with handed(t):  # see pipeline/comm/handed.py
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got: list[list[list[float]]] = t.cpu().tolist()
        return got
