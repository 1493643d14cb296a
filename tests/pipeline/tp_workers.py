"""Functions run on spawned gloo ranks by tests/pipeline/test_tensor_parallel.py: Pipes on a
(dp, pp, tp) mesh against one device (importable by child processes, so they live in a
module of their own)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline import Pipe, PipeConfigError, PipelineError
from tests import models_tp
from tests.pipeline.sharded_workers import pack
from tests.pipeline.traced_workers import STATE_TOL, TOL, TWO_PER_RANK

__all__ = ["dropout_replay", "errors", "failure_names_coordinates",
           "llama_like_one_device", "llama_plan", "load_elsewhere", "planned",
           "save_and_load_elsewhere", "save_at", "train_like_one_device", "two_bw_rule"]

BALANCE = {("mlp", 1): [6], ("mlp", 2): [3, 3], ("transformer", 1): [7],
           ("transformer", 2): [4, 3], ("transformer", 4): [2, 2, 2, 1], ("mlp", 4): [2, 1, 1, 2]}
STEPS = 2


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] = ("dp", "pp", "tp")) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _build(name: str, dropout: float = 0.0) -> nn.Sequential:
    return models_tp.mlp() if name == "mlp" else models_tp.transformer(dropout=dropout)


def _plan(name: str, variant: str) -> dict[str, Any]:
    return (models_tp.mlp_plan() if name == "mlp"
            else models_tp.transformer_plan(sequence_parallel=variant == "sp"))


def _loss(name: str) -> Callable[[Any, Any], torch.Tensor]:
    return nn.MSELoss() if name == "mlp" else models_tp.token_loss


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (every tp rank calls this for every DTensor, in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(pipe: Pipe, name: str, step: int, mesh: Any) -> torch.Tensor:
    """One step on this replica's rows of the global batch; ranks pass what their stages
    need (None for the rest), as ranks of a real job would."""
    x, y = models_tp.batch(name, step)
    dp = mesh["dp"].size()
    d = mesh.get_local_rank("dp")
    x, y = x.chunk(dp)[d], y.chunk(dp)[d]
    first, last = 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages
    return pipe.step(x if first else None, y if last else None, _loss(name))


def _ref_loss(ref: nn.Module, name: str, step: int) -> torch.Tensor:
    x, y = models_tp.batch(name, step)
    return _loss(name)(ref(x), y)


def _llama_step(pipe: Pipe, case: Any, step: int) -> torch.Tensor:
    from tests.models_traced import token_count

    first, last = 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages
    return pipe.step(case.inputs if first else None, case.labels if last else None, case.loss,
                     loss_weight=token_count)


def _compare(pipe: Pipe, ref: nn.Module, pipe_step: Callable[[int], torch.Tensor],
             ref_step: Callable[[int], torch.Tensor], what: str, *, lr: float,
             clip: float | None = None) -> list[str]:
    """`STEPS` AdamW steps of `pipe` and of `ref` (the model on one device): each step's loss,
    every gradient (clipped to `clip` on the second step, with the norm compared) and every
    weight after the steps agree. Returns the names of the parameters this rank checked."""
    opt = torch.optim.AdamW(pipe.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    refs = dict(ref.named_parameters())
    for step in range(STEPS):
        loss = pipe_step(step)
        ref_loss = ref_step(step)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=what)
        if step == 1 and clip is not None:
            norm = pipe.clip_grad_norm_(clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            torch.testing.assert_close(norm, ref_norm, **TOL, msg=what)
        for n, p in pipe.named_parameters():
            assert p.grad is not None, (what, n)
            torch.testing.assert_close(_full(p.grad), refs[n].grad, **TOL,
                                       msg=f"{what}: {n}'s gradient, step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    names = []
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(_full(p.detach()), refs[n].detach(), **STATE_TOL,
                                   msg=f"{what}: {n} after the steps")
        names.append(n)
    return names


def train_like_one_device(rank: int, shape: tuple[int, int, int],
                          runs: list[tuple[str, str, str, str]],
                          data_parallel: str = "replicate") -> list[list[str]]:
    """For each (model, plan variant, schedule, checkpoint): two AdamW steps of a Pipe on the
    mesh and of the model on one device (the global batch); every step's loss, every
    gradient (after `clip_grad_norm_` on the second step, with the norm) and every weight
    after the steps must agree (`data_parallel="fsdp"`: FSDP2 over "dp", TP over "tp", as
    torchtitan composes them). Returns the parameter names each run checked."""
    mesh = _mesh(shape)
    checked = []
    for name, variant, schedule, checkpoint in runs:
        what = f"{name}/{variant}/{schedule}/{checkpoint} at {shape}, {data_parallel}"
        ref = _build(name)
        stages = shape[1] * (2 if schedule in TWO_PER_RANK else 1)
        pipe = Pipe(_build(name), balance=BALANCE[(name, stages)], chunks=2, mesh=mesh,
                    tp_plan=_plan(name, variant), schedule=schedule, checkpoint=checkpoint,
                    data_parallel=data_parallel)
        names = _compare(pipe, ref, functools.partial(_step, pipe, name, mesh=mesh),
                         functools.partial(_ref_loss, ref, name), what, lr=1e-2, clip=0.05)
        pipe.close()
        checked.append(names)
    return checked


def dropout_replay(rank: int) -> list[float]:
    """The transformer with dropout (after attention and MLP, where activations are whole on
    every tp rank, and on the MLP's hidden units, where each tp rank holds its shard) on
    1x2x2, every process seeded differently: recomputation ("always") replays the masks of
    the forward it recomputes, so its gradients equal those of "never" bit for bit; and the
    tp ranks drew the same masks (tp rank 0's seed), so they computed one loss. Returns
    this rank's losses."""
    mesh = _mesh((1, 2, 2))
    grads = {}
    losses = []
    for checkpoint in ("never", "always"):
        torch.manual_seed(1234 + rank)  # what a user might do; the ranks must still agree
        pipe = Pipe(_build("transformer", dropout=0.3), balance=[4, 3], chunks=2, mesh=mesh,
                    tp_plan=_plan("transformer", "megatron"), checkpoint=checkpoint)
        torch.manual_seed(99)  # the step's seed: the same draw for both runs
        losses.append(float(_step(pipe, "transformer", 0, mesh)))
        grads[checkpoint] = {n: _full(p.grad).clone() for n, p in pipe.named_parameters()
                             if p.grad is not None}
        pipe.close()
    assert grads["never"].keys() == grads["always"].keys()
    for n, g in grads["never"].items():
        assert torch.equal(g, grads["always"][n]), f"{n}: recomputation drew other masks"
    no_dropout = Pipe(_build("transformer"), balance=[4, 3], chunks=2, mesh=mesh,
                      tp_plan=_plan("transformer", "megatron"))
    plain = float(_step(no_dropout, "transformer", 0, mesh))
    assert abs(plain - losses[0]) > 1e-3, "dropout changed nothing: the test would be vacuous"
    no_dropout.close()
    return losses


def save_at(rank: int, path: str) -> tuple[bytes, bytes | None]:
    """1x2x2: one AdamW step of the transformer, then `pipe.save(path)`; returns the whole
    model's state (every tp rank gathers each DTensor) for the loads to compare with."""
    mesh = _mesh((1, 2, 2))
    pipe = Pipe(_build("transformer"), balance=[4, 3], chunks=2, mesh=mesh,
                tp_plan=_plan("transformer", "megatron"))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    _step(pipe, "transformer", 0, mesh)
    opt.step()
    pipe.save(Path(path))
    state = {k: _full(v).detach().clone() for k, v in pipe.state_dict().items()}
    full = pipe.full_state_dict()
    pipe.close()
    # A whole state_dict loads into a tp Pipe as each rank's shards.
    other = models_tp.transformer(seed=3).state_dict()
    fresh = Pipe(_build("transformer"), balance=[4, 3], chunks=2, mesh=mesh,
                 tp_plan=_plan("transformer", "megatron"))
    fresh.load_state_dict(other)
    for k, v in fresh.state_dict().items():
        assert torch.equal(_full(v), other[k]), k
    fresh.close()
    return pack(state), pack(full) if full is not None else None


def save_and_load_elsewhere(rank: int, path: str) -> tuple[bytes, bytes | None, bytes]:
    """`save_at`, then (every rank's shards written) `load_elsewhere`, on one set of ranks:
    both functions' results."""
    saved, full = save_at(rank, path)
    torch.distributed.barrier()
    return saved, full, load_elsewhere(rank, path)


def load_elsewhere(rank: int, path: str) -> bytes:
    """1x4x1 (no tp): `pipe.load(path)` of what 1x2x2 saved; returns this rank's state."""
    mesh = _mesh((1, 4), ("dp", "pp"))
    pipe = Pipe(models_tp.transformer(seed=7), balance=[2, 2, 2, 1], chunks=4, mesh=mesh)
    pipe.load(Path(path))
    state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    return pack(state)


def errors(rank: int) -> list[str]:
    """Mistakes with tp, each refused with its reason on every rank (1x2x2)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh = _mesh((1, 2, 2))
    seen = []

    def refused(**kwargs: Any) -> None:
        try:
            Pipe(**{"model": _build("transformer"), "balance": [4, 3], "mesh": mesh,
                    **kwargs})
        except PipeConfigError as exc:
            seen.append(str(exc))
        else:
            raise AssertionError(f"accepted {kwargs}")

    refused()  # a tp dimension and no plan
    refused(tp_plan={"*.atn.q": ColwiseParallel()})  # a typo
    tied = models_tp.transformer()
    tied[6].weight = tied[0].weight
    refused(model=tied, tp_plan=_plan("transformer", "megatron"))
    # The tp ranks of a stage disagree (one shards the MLP by rows first).
    mine = _plan("transformer", "megatron")
    if mesh.get_local_rank("tp") == 1:
        mine["*.mlp.fc"], mine["*.mlp.proj"] = mine["*.mlp.proj"], mine["*.mlp.fc"]
    refused(tp_plan=mine)
    return seen


def failure_names_coordinates(rank: int) -> tuple[str, list[str]]:
    """1x2x2: the loss raises on the last stage's tp rank 1 (global rank 3) only; every rank
    fails with a PipelineError, and the others' name where the failure was. Then every later
    call (a step, an inference) raises a PipelineError too: (the failure, what each later call
    raised)."""
    mesh = _mesh((1, 2, 2))
    pipe = Pipe(_build("mlp"), balance=[3, 3], chunks=2, mesh=mesh, tp_plan=_plan("mlp", ""),
                timeout=60)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if rank == 3:
            raise ValueError("a loss that fails on one shard")
        return nn.functional.mse_loss(out, target)

    x, y = models_tp.batch("mlp", 0)
    try:
        pipe.step(x, y, loss)
    except PipelineError as exc:
        first = str(exc)
    else:
        raise AssertionError("the step did not fail")
    later = []
    for call in (lambda: pipe.step(x, y, nn.functional.mse_loss), lambda: pipe(x)):
        try:
            call()
            later.append("no error")
        except Exception as exc:
            later.append(f"{type(exc).__name__}: {exc}")
    return first, later


def llama_plan() -> dict[str, Any]:
    """Megatron's plan for Hugging Face Llama's attention and MLP (as torchtitan's)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = "model.layers.*."
    return {**{f"{layer}self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            f"{layer}self_attn.o_proj": RowwiseParallel(),
            **{f"{layer}mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")},
            f"{layer}mlp.down_proj": RowwiseParallel()}



def llama_like_one_device(rank: int, runs: list[tuple[str, str]]) -> list[list[str]]:
    """Hugging Face Llama split by module names inside Pipe (`example_inputs=`,
    `split_points=`) with a tp plan for its attention and MLP, on 1x2x2 (two stages per rank
    for interleaved): two AdamW steps whose losses, gradients and weights equal the unsplit
    model's on one device. Returns the parameter names each run checked."""
    from tests.models_traced import exports_reused, llama_case

    mesh = _mesh((1, 2, 2))
    case = llama_case()
    checked = []
    # Each run's Pipe splits a fresh model; the graph, the same for all, is exported once.
    with exports_reused():
        for schedule, checkpoint in runs:
            what = f"llama/{schedule}/{checkpoint}"
            points = (["model.layers.1", "model.layers.2", "model.layers.3"]
                      if schedule in TWO_PER_RANK else ["model.layers.2"])
            ref = case.model()
            pipe = Pipe(case.model(), example_inputs=case.inputs, split_points=points,
                        chunks=2, mesh=mesh, tp_plan=llama_plan(), schedule=schedule,
                        checkpoint=checkpoint)
            names = _compare(pipe, ref, functools.partial(_llama_step, pipe, case),
                             lambda _i, ref=ref: case.loss(ref(**case.inputs), case.labels),
                             what, lr=1e-3)
            pipe.close()
            checked.append(names)
    return checked


def two_bw_rule(rank: int) -> int:
    """PipeDream-2BW on 1x2x2 with the MLP's plan: `step` and `step_many` follow the
    one-step-stale rule W(t+1) = W(t) - lr * grad f(W(t-1)) on one device (losses and the
    weights after three batches). Returns the runs checked."""
    from tests.pipeline.test_pipe import _two_bw_reference

    mesh = _mesh((1, 2, 2))
    data, lr = [models_tp.batch("mlp", t) for t in range(3)], 0.5
    final = models_tp.mlp()
    expected = _two_bw_reference(final, data, lr)
    ref = dict(final.named_parameters())
    for many in (False, True):
        pipe = Pipe(models_tp.mlp(), [3, 3], chunks=2, schedule="2bw", mesh=mesh,
                    tp_plan=models_tp.mlp_plan())
        optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)
        if many:
            losses = [v.item() for v in pipe.step_many(data, nn.MSELoss(), optimizer)]
        else:
            losses = []
            for x, y in data:
                optimizer.zero_grad()
                losses.append(pipe.step(x, y, nn.MSELoss()).item())
                optimizer.step()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(_full(p.detach()), ref[name].detach(), **TOL,
                                       msg=f"step_many={many}: {name}")
        pipe.close()
    return 2


def planned(rank: int, shape: tuple[int, int, int], kwargs: dict[str, Any]) -> list[str]:
    """A plan's Pipe (`plan(...).pipe_kwargs(mesh=mesh)`) for the transformer on its
    (dp, pp, tp) mesh: two AdamW steps equal one device's. Returns the names checked."""
    mesh = _mesh(shape)
    pipe = Pipe(_build("transformer"), **kwargs, mesh=mesh)
    ref = _build("transformer")
    names = _compare(pipe, ref, functools.partial(_step, pipe, "transformer", mesh=mesh),
                     functools.partial(_ref_loss, ref, "transformer"), "planned", lr=1e-2)
    pipe.close()
    return names
