"""Run on spawned gloo ranks by tests/pipeline/planner/test_plan.py: a dp x pp plan's Pipe."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from pipeline import Pipe
from pipeline.examples.models import get_model


def step_planned(rank: int, dp: int, pp: int, kwargs: dict[str, Any]) -> float:
    """Each replica steps its half of the tiny model's batch under the plan's arguments; the
    returned loss is the global batch's."""
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    spec = get_model("tiny")
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    pipe = Pipe(model, **kwargs, mesh=mesh)
    rows = len(x) // dp
    d = mesh.get_local_rank("dp")
    try:
        got = pipe.step(x[d * rows:(d + 1) * rows], y[d * rows:(d + 1) * rows], loss)
    finally:
        pipe.close()
    with torch.no_grad():
        expected = loss(spec.build()(x), y)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (rank, got, expected)
    return float(got)


def plan_with_trials(rank: int) -> tuple[Any, ...]:
    """Every rank plans the tiny model with trials over gloo, profiling it itself; what each
    chose and measured."""
    from pipeline import plan
    from pipeline.planner import Link

    spec = get_model("tiny")
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    p = plan(model, x, y, loss, ranks=2, memory_per_rank=None, transport="gloo",
             link=Link("gloo", 1e-4, 1e-9), contention=1.0, chunks=[1, 2], repeats=1,
             schedules=["gpipe", "1f1b"], checkpoints=["never"], trials=8, trial_rounds=2,
             trial_steps=1, trial_warmup=0)  # every candidate: which are best depends on the
    # profile this run measures, and the test must see both layouts measured
    assert p.trials is not None and p.measured_step_time is not None
    assert p.time_model is not None  # fitted from every trial's steps, every rank's events
    timed = sum(len(t.times) for t in p.trials.trials)
    return (p.schedule, p.chunks, p.dp, p.pp, p.balance, p.measured_step_time,
            [t.times for t in p.trials.trials], (p.time_model.samples, timed),
            (p.time_model.compute, p.time_model.allreduce),
            sorted({(t.candidate.dp, t.candidate.pp) for t in p.trials.trials}))


def fit_replicas(rank: int, delay: float) -> tuple[float, float]:
    """Every rank plans the tiny model as two replicas (dp 2 x pp 1) with trials over gloo,
    each gradient average `delay` seconds longer (a sleep once it is written); the all-reduce
    term fitted from the replicas' timelines, and the planner's own price of what the
    all-reduce costs the rank (`reduce_tails` of the candidate's prediction, no model)."""
    import time

    from pipeline import plan
    from pipeline.parallel.data_parallel import GradSync
    from pipeline.planner import Link, predict
    from pipeline.planner.time_model import reduce_tails

    finish = GradSync.finish

    def late(self: GradSync) -> None:
        finish(self)
        time.sleep(delay)

    GradSync.finish = late  # type: ignore[method-assign]
    spec = get_model("tiny")
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    link = Link("gloo", 1e-4, 1e-9, collective_latency=1e-3, collective_per_byte=1e-9)
    try:
        p = plan(model, x, y, loss, ranks=2, memory_per_rank=None, transport="gloo", link=link,
                 contention=1.0, chunks=[2], repeats=1, schedules=["gpipe"],
                 checkpoints=["never"], data_parallel=[2], trials=1, trial_rounds=3,
                 trial_steps=2, trial_warmup=1)
    finally:
        GradSync.finish = finish  # type: ignore[method-assign]
    assert p.time_model is not None and p.dp == 2
    alone = predict(p.profile, link, schedule="gpipe", chunks=2, checkpoint="never", pp=1,
                    dp=2, balance=p.balance)
    assert alone.timeline is not None
    (price,) = reduce_tails(alone.timeline).values()
    return p.time_model.allreduce, price


class _FailsAt(torch.nn.Module):
    """Passes its input on; once `armed`, raises on rank `rank` for micro-batches of `rows`
    rows (a stage running out of memory on one rank, inside the runtime)."""

    armed = False

    def __init__(self, rank: int, rows: int) -> None:
        super().__init__()
        self.rank, self.rows = rank, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if _FailsAt.armed and dist.get_rank() == self.rank and x.shape[0] == self.rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a trial on rank 1)")
        return x


def plan_past_a_failing_trial(rank: int) -> tuple[Any, ...]:
    """Every rank plans the tiny model with trials over gloo, where 2 micro-batches run out of
    memory on rank 1 alone: what each chose, and the failure each recorded."""
    from pipeline import plan
    from pipeline.planner import Link

    spec = get_model("tiny")
    layers, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    model = torch.nn.Sequential(*layers, _FailsAt(1, len(x) // 2))
    kw: dict[str, Any] = {"ranks": 2, "memory_per_rank": None, "transport": "gloo",
                          "link": Link("gloo", 1e-4, 1e-9), "contention": 1.0, "chunks": [1, 2],
                          "schedules": ["gpipe"], "checkpoints": ["never"],
                          "data_parallel": [1], "repeats": 1}
    profile = plan(model, x, y, loss, **kw).profile  # measured before the failure is armed
    _FailsAt.armed = True
    try:
        p = plan(model, x, y, loss, profile=profile, trials=2, trial_rounds=2, trial_steps=1,
                 trial_warmup=0, **kw)
    finally:
        _FailsAt.armed = False
    assert p.trials is not None
    return (p.chunks, [(c.chunks, why) for c, why in p.trials.failed],
            [t.candidate.chunks for t in p.trials.trials])
