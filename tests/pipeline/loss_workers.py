"""Functions run on spawned gloo ranks by tests/pipeline/test_loss_weighting_dist.py: padded
language-model labels over processes and over a dp x pp mesh, against one device."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe
from tests.models import ClassesFirst, FlattenTokens, lm_loss, tiny_lm
from tests.pipeline.reference import grads_equal

__all__ = ["flattened_head", "model_loss_dp", "model_loss_pp", "padded_labels_dp",
           "padded_labels_pp"]

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, summation order only
VOCAB, CONTEXT = 13, 8


def _labels(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and labels whose rows count 0..8 tokens (-100 after them): unequal micro-batches,
    and replicas holding unequal token counts."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (rows, CONTEXT), generator=g)
    labels = torch.randint(0, VOCAB, (rows, CONTEXT), generator=g)
    counts = torch.randint(0, CONTEXT + 1, (rows,), generator=g)
    counts[step % rows] = 0  # a row of padding only
    for r in range(rows):
        labels[r, int(counts[r]):] = -100
    return ids, labels


def _token_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels != -100).sum()


_CASES: dict[str, tuple[Callable[[], nn.Module | None], Callable[..., torch.Tensor],
                        dict[str, Any]]] = {
    # nn.CrossEntropyLoss weighs by counted tokens on its own; a plain function is told.
    "module": (ClassesFirst, nn.CrossEntropyLoss(label_smoothing=0.1), {}),
    "loss_weight": (lambda: None, lm_loss, {"loss_weight": _token_count}),
}


def _lm(case: str) -> nn.Sequential:
    model = tiny_lm(VOCAB, 16, depth=4, context=CONTEXT, dropout=0.0)
    head = _CASES[case][0]()
    if head is not None:
        model.append(head)
    return model


def _compare(pipe: Pipe, reference: nn.Module, loss: torch.Tensor, expected: torch.Tensor,
             what: str) -> None:
    torch.testing.assert_close(loss, expected.detach(), **TOL, msg=lambda m: f"{what}: {m}")
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


def padded_labels_pp(rank: int, combos: list[tuple[str, str, list[int]]]) -> int:
    """Two pipeline ranks, the tied head on the last: per (schedule, checkpoint, balance) and
    weighting case, two accumulating steps equal the plain model's on every rank."""
    checked = 0
    for schedule, checkpoint, balance in combos:
        for case, (_, loss_fn, kwargs) in _CASES.items():
            model = _lm(case)
            reference = copy.deepcopy(model)
            layers = balance if case == "module" else [*balance[:-1], balance[-1] - 1]
            pipe = Pipe(model, layers, chunks=3, schedule=schedule, checkpoint=checkpoint)
            first, last = 0 in pipe.local_stages, len(layers) - 1 in pipe.local_stages
            for step in range(2):
                ids, labels = _labels(step)
                loss = pipe.step(ids if first else None, labels if last else None, loss_fn,
                                 **kwargs)
                expected = loss_fn(reference(ids), labels)
                expected.backward()
                _compare(pipe, reference, loss, expected, f"{schedule}/{checkpoint}/{case}")
            pipe.close()
            checked += 1
    return checked


def padded_labels_dp(rank: int, schedules: list[str]) -> int:
    """dp x pp = 2 x 2: replicas hold shards with unequal token counts; the loss and every
    gradient are the global batch's, weighted by the global count of tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    checked = 0
    for schedule in schedules:
        for case, (_, loss_fn, kwargs) in _CASES.items():
            model = _lm(case)
            reference = copy.deepcopy(model)
            pipe = Pipe(model, [4, len(model) - 4], chunks=2, schedule=schedule, mesh=mesh)
            for step in range(2):
                ids, labels = _labels(step + 10)
                # Uneven shards: 3 rows and 5 rows, and different counts of tokens.
                rows = slice(0, 3) if dp_rank == 0 else slice(3, 8)
                loss = pipe.step(ids[rows], labels[rows], loss_fn, **kwargs)
                expected = loss_fn(reference(ids), labels)
                expected.backward()
                _compare(pipe, reference, loss, expected, f"dp/{schedule}/{case}")
            pipe.close()
            checked += 1
    return checked


def flattened_head(rank: int) -> float:
    """A head that flattens tokens into rows, and a loss that flattens the target: trains
    exactly over two processes (the target's rows are checked against the input's)."""
    model = _lm("loss_weight").append(FlattenTokens())
    reference = copy.deepcopy(model)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target.reshape(-1))

    pipe = Pipe(model, [4, 4], chunks=3)
    ids, labels = _labels(0)
    labels = labels.clamp(min=0)  # every token counts: rows weigh the micro-batches right
    loss = pipe.step(ids, labels, loss_fn)
    expected = loss_fn(reference(ids), labels)
    expected.backward()
    _compare(pipe, reference, loss, expected, "flattened head")
    out = pipe(ids)
    if rank == 1:
        assert out.shape == (8 * CONTEXT, VOCAB), out.shape
    pipe.close()
    return float(loss)


def _model_loss(out: Any, target: Any) -> torch.Tensor:
    """The loss a Hugging Face model computes itself from `labels=` in its inputs."""
    return out.loss


def _traced(name: str) -> tuple[nn.Module, nn.Module, dict[str, Any], list[str]]:
    """A Hugging Face causal LM (`name`: llama, gpt2), an unsplit copy, its inputs with padded
    labels (micro-batches counting unequal tokens, one none) and its blocks."""
    from tests.models_traced import gpt2_case, llama_case

    case = {"llama": llama_case, "gpt2": gpt2_case}[name]()
    model = case.model()
    return model, copy.deepcopy(model), {**case.inputs, "labels": case.labels}, case.blocks



def model_loss_pp(rank: int, runs: list[tuple[str, str]]) -> int:
    """Two pipeline ranks, `labels=` in the inputs and the model's own `out.loss`, no
    loss_weight=: every rank passes the inputs (the last counts the tokens in them), the
    last the labels as target, the first None; the loss and this rank's gradients equal the
    unsplit model's. Returns the parameters checked."""
    from tests.models_traced import exports_reused

    checked = 0
    with exports_reused():  # each model's graph exported once, split for each schedule
        for name, schedule in runs:
            model, reference, inputs, blocks = _traced(name)
            pipe = Pipe(model, example_inputs=inputs, split_points=[blocks[2]], chunks=4,
                        schedule=schedule)
            last = len(pipe.balance) - 1 in pipe.local_stages
            loss = pipe.step(inputs, inputs["labels"] if last else None, _model_loss)
            expected = reference(**inputs).loss
            expected.backward()
            checked += grads_equal(model, reference, loss, expected, f"{name}/{schedule}",
                                   TOL)
            pipe.close()
    return checked


def model_loss_dp(rank: int, runs: list[tuple[str, str]]) -> int:
    """dp x pp = 2 x 2, the model's own `out.loss`: replicas hold 3 and 5 rows counting
    unequal tokens; the loss and every gradient are the global batch's (the unsplit model's on
    all 8 rows), each micro-batch weighted by its share of the count over both replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    rows = slice(0, 3) if mesh.get_local_rank("dp") == 0 else slice(3, 8)
    from tests.models_traced import exports_reused

    checked = 0
    with exports_reused():  # each model's graph exported once, split for each schedule
        for name, schedule in runs:
            model, reference, inputs, blocks = _traced(name)
            shard = {k: v[rows] if isinstance(v, torch.Tensor) else v
                     for k, v in inputs.items()}
            pipe = Pipe(model, example_inputs=shard, split_points=[blocks[2]], chunks=2,
                        schedule=schedule, mesh=mesh)
            loss = pipe.step(shard, None, _model_loss)
            expected = reference(**inputs).loss
            expected.backward()
            checked += grads_equal(model, reference, loss, expected, f"dp/{name}/{schedule}",
                                   TOL)
            pipe.close()
    return checked
