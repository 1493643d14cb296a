"""Run on spawned gloo ranks by tests/pipeline/test_torch_interop.py: our schedules in torch's
runtime and torch's schedules in our Pipe, one training step each, against one device; and a
torch.distributed.pipelining program beside its port to Pipe (docs/from-torch-pipelining.md)."""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

import schedules
from pipeline import Pipe
from schedules import Schedule
from tests.pipeline.dist_workers import TOL
from tests.torch_csv import torch_csv

__all__ = ["exchange", "ours_in_torch", "ported", "torch_in_ours"]

_LAYERS = 8  # enough for two stages on each of 4 ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(_LAYERS):
        layers.append(nn.Linear(5 if i == 0 else 7, 3 if i == _LAYERS - 1 else 7))
        if i % 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _balance(num_stages: int) -> list[int]:
    size = len(_model())
    return [size // num_stages + (1 if s < size % num_stages else 0) for s in range(num_stages)]


def _data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Two rows per micro-batch: torch splits a batch into equal chunks only, and with equal
    # chunks its mean of per-micro-batch mean losses is the batch's mean loss.
    torch.manual_seed(m)
    return torch.randn(2 * m, 5), torch.randn(2 * m, 3)


def _reference(model: nn.Module, m: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One device's loss and gradients on the batch of m micro-batches."""
    reference = copy.deepcopy(model)
    x, y = _data(m)
    loss = nn.MSELoss()(reference(x), y)
    loss.backward()
    grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _check(grads: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor],
           what: str) -> None:
    assert grads, f"{what}: this rank holds no parameters"
    for name, grad in grads.items():
        assert grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(grad, expected[name], **TOL,
                                   msg=lambda msg, n=name: f"{what}: {n}: {msg}")


def _layers_of(model: nn.Sequential, balance: Sequence[int], stage: int) -> nn.Sequential:
    start = sum(balance[:stage])
    return nn.Sequential(*list(model)[start:start + balance[stage]])


def ours_in_torch(rank: int, cases: list[tuple[str, int, dict[str, int]]], lowered: bool
                  ) -> list[str]:
    """For each (our schedule, m, options): write `dump_csv(lower(s))` (or the compute-only
    CSV), load it into torch's `_PipelineScheduleRuntime`, take one step and compare this rank's
    gradients with one device's. Returns what was checked."""
    done = []
    p = torch.distributed.get_world_size()
    for name, m, options in cases:
        s = schedules.get_schedule(name, p, m, **options)
        model = _model()
        expected_loss, expected = _reference(model, m)
        balance = _balance(s.num_stages)
        stages = [PipelineStage(_layers_of(model, balance, i), i, s.num_stages,
                                torch.device("cpu")) for i in s.stages_of(rank)]
        runtime = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=nn.MSELoss())
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ours.csv")
            schedules.dump_csv(schedules.lower(s) if lowered else s, path)
            runtime._load_csv(path, format="compute_comms" if lowered else "compute_only")
        x, y = _data(m)
        first, last = 0 in s.stages_of(rank), s.num_stages - 1 in s.stages_of(rank)
        what = f"{name} p={p} m={m} in torch ({'with comms' if lowered else 'compute-only'})"
        if last:
            losses: list[torch.Tensor] = []
            runtime.step(*((x,) if first else ()), target=y, losses=losses)
            # Equal micro-batches: the mean of their mean losses is the batch's mean loss.
            torch.testing.assert_close(torch.stack(losses).mean().detach(), expected_loss,
                                       **TOL, msg=lambda msg, w=what: f"{w}: loss: {msg}")
        else:
            runtime.step(*((x,) if first else ()))
        grads = {n: q.grad for st in stages for n, q in _named(model, st.submod)}
        _check(grads, expected, what)
        done.append(what)
    return done


def _named(model: nn.Module, part: nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """`part`'s parameters under their names in `model` (the stage wraps the model's layers)."""
    ids = {id(q) for q in part.parameters()}
    return [(n, q) for n, q in model.named_parameters() if id(q) in ids]


def torch_in_ours(rank: int, cases: list[tuple[str, int, bool, int | None]]) -> list[str]:
    """For each (torch class, m, with comms, stages per rank or None for torch's default):
    load torch's CSV with our reader, run it through our Pipe (the loaded Schedule as
    `schedule=`), compare the loss and this rank's gradients."""
    done = []
    p = torch.distributed.get_world_size()
    for cls, m, comms, k in cases:
        text = torch_csv(cls, p, m, comms=comms, stages_per_rank=k)
        loaded: Schedule = schedules.validate(schedules.loads_csv(text, num_microbatches=m))
        model = _model()
        expected_loss, expected = _reference(model, m)
        pipe = Pipe(model, _balance(loaded.num_stages), chunks=m, schedule=loaded,
                    checkpoint="never")
        x, y = _data(m)
        first = 0 in pipe.local_stages
        last = loaded.num_stages - 1 in pipe.local_stages
        loss = pipe.step(x if first else None, y if last else None, nn.MSELoss())
        what = (f"torch's {cls} p={p} m={m}, {loaded.stages_per_rank} stage(s) per rank "
                f"({'with comms' if comms else 'compute-only'}) in ours")
        torch.testing.assert_close(loss, expected_loss, **TOL,
                                   msg=lambda msg, w=what: f"{w}: loss: {msg}")
        _check({n: q.grad for n, q in pipe.named_parameters()}, expected, what)
        done.append(what)
    return done


def exchange(rank: int, ours: list[tuple[str, int, dict[str, int]]],
             theirs: list[tuple[str, int, bool, int | None]]) -> list[str]:
    """Both directions on one set of ranks: ours in torch (with comms and compute-only), then
    torch's in ours."""
    return (ours_in_torch(rank, ours, True) + ours_in_torch(rank, ours, False)
            + torch_in_ours(rank, theirs))


def _torch_step(cls: str, stages_per_rank: int, m: int
                ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
    """One step of torch's `cls` on this rank's stages (rank r holds stages r, r + p, ...):
    its `losses=` list (empty off the last stage's rank) and this rank's gradients."""
    rank, p = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, num_stages = _model(), p * stages_per_rank
    balance = _balance(num_stages)
    stages = [PipelineStage(_layers_of(model, balance, i), i, num_stages, torch.device("cpu"))
              for i in range(rank, num_stages, p)]
    schedule_cls = getattr(torch_schedules, cls)
    schedule = schedule_cls(stages if stages_per_rank > 1 else stages[0], n_microbatches=m,
                            loss_fn=nn.MSELoss())  # scale_grads=True, torch's default
    x, y = _data(m)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    else:  # the last stage is on the last rank under the loop placement
        schedule.step(target=y, losses=losses)
    return losses, {n: q.grad for st in stages for n, q in _named(model, st.submod)}


def _pipe_step(name: str, stages_per_rank: int, m: int
               ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
    """The same step ported to Pipe: `losses=` and this rank's gradients."""
    p = torch.distributed.get_world_size()
    pipe = Pipe(_model(), _balance(p * stages_per_rank), chunks=m, schedule=name,
                checkpoint="never")  # torch recomputes nothing; Pipe's default is except_last
    x, y = _data(m)
    first, last = 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages
    losses: list[torch.Tensor] = []
    pipe.step(x if first else None, y if last else None, nn.MSELoss(), losses=losses)
    grads = {n: q.grad for n, q in pipe.named_parameters()}
    pipe.close()
    return losses, grads


def ported(rank: int, cases: list[tuple[str, str, int, int]]) -> list[str]:
    """For each (torch class, our schedule, stages per rank, m): torch's step and Pipe's on the
    same model and batch leave the same per-micro-batch losses (on the last stage's rank) and
    the same gradients, bit for bit. Returns what was checked."""
    done = []
    for cls, name, k, m in cases:
        what = f"{cls} -> Pipe(schedule={name!r}), m={m}, rank {rank}"
        theirs, their_grads = _torch_step(cls, k, m)
        ours, our_grads = _pipe_step(name, k, m)
        assert len(ours) == len(theirs) == (m if rank == 1 else 0), (what, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(a, b.detach()), f"{what}: micro-batch {i}: {a} != {b}"
        assert our_grads.keys() == their_grads.keys() and our_grads, what
        for n, g in our_grads.items():
            expected = their_grads[n]
            assert g is not None and expected is not None, (what, n)
            assert torch.equal(g, expected), f"{what}: {n}: {(g - expected).abs().max()}"
        done.append(what)
    return done
