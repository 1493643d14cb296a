"""Functions run on spawned gloo ranks by tests/pipeline/test_traced_dist.py: Hugging Face
models captured at one length, trained and run at others, over 2 pipeline ranks and over a
dp x pp = 2 x 2 mesh with a length per replica (importable by child processes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline import Pipe
from tests.models_lengths import batch, length_case
from tests.models_traced import token_count, token_loss
from tests.pipeline.reference import grads_equal

__all__ = ["dtypes_pp", "lengths_dp", "lengths_pp"]

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, summation order only (tests/models_traced.py)



def _step_equal(pipe: Pipe, model: nn.Module, reference: nn.Module, inputs: dict[str, Any],
                labels: torch.Tensor, what: str, tol: dict[str, float]) -> int:
    """One step from zeroed gradients, the first rank passing the inputs and the last the
    labels, against the unsplit model's: the gradients this rank checked."""
    first, last = 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    loss = pipe.step(inputs if first else None, labels if last else None, token_loss,
                     loss_weight=token_count)
    expected = token_loss(reference(**inputs), labels)
    expected.backward()
    return grads_equal(model, reference, loss, expected, what, tol)


def lengths_pp(rank: int, runs: list[tuple[str, str]], lengths: list[int]) -> dict[str, Any]:
    """Per (model, schedule): captured at 12, trained at each of `lengths`, the first rank
    passing the inputs, the last the labels, the others None (the ranks agree on the shapes);
    then inference at 20 in eval mode. Returns the gradients checked and the captures."""
    checked, captures = 0, []
    for name, schedule in runs:
        case = length_case(name)
        model, reference = case.model(), case.model()
        two = schedule in ("interleaved", "zb-v")
        pipe = Pipe(model, example_inputs=case.inputs, chunks=4, schedule=schedule,
                    split_points=case.blocks[1:] if two else [case.blocks[2]])
        first = 0 in pipe.local_stages
        for seed, length in enumerate(lengths):
            inputs, labels = batch(name, length, seed=seed + 1)
            checked += _step_equal(pipe, model, reference, inputs, labels,
                                   f"{name}/{schedule}/{length}", TOL)
        inputs, _ = batch(name, 20, rows=6, seed=9)
        model.eval()
        reference.eval()
        with torch.no_grad():
            out = pipe(inputs if first else None)
            if out is not None:
                torch.testing.assert_close(out.logits, reference(**inputs).logits, **TOL)
        captures.append(pipe._io.lengths.captures)
        pipe.close()
    return {"checked": checked, "captures": captures}


def lengths_dp(rank: int, runs: list[tuple[str, str]]) -> int:
    """dp x pp = 2 x 2: replica 0 trains on 4 rows of 16 tokens, replica 1 on 4 rows of 7,
    in the same step (one capture, at 12): the loss and every gradient are the unsplit
    model's over both batches (the token sums of both over both counts)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    checked = 0
    for name, schedule in runs:
        case = length_case(name, rows=4)
        model, reference = case.model(), case.model()
        pipe = Pipe(model, example_inputs=case.inputs, split_points=[case.blocks[2]],
                    chunks=2, schedule=schedule, mesh=mesh)
        first, last = 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages
        shards = [batch(name, length, rows=4, seed=s) for s, length in enumerate([16, 7])]
        inputs, labels = shards[replica]
        loss = pipe.step(inputs if first else None, labels if last else None, token_loss,
                         loss_weight=token_count)
        total = sum(token_count(y) for _, y in shards)
        expected = sum(nn.functional.cross_entropy(
            reference(**x).logits.flatten(0, 1), y.flatten(), ignore_index=-100,
            reduction="sum") for x, y in shards) / total
        assert isinstance(expected, torch.Tensor)
        expected.backward()
        checked += grads_equal(model, reference, loss, expected, f"dp/{name}/{schedule}", TOL)
        pipe.close()
    return checked


def dtypes_pp(rank: int, schedule: str) -> dict[str, Any]:
    """Llama captured in float32, then `pipe.to(torch.float64)` on each rank (which converts
    only its own stage): two steps, the first rank passing the inputs, the last the labels;
    the loss and every gradient equal the unsplit model's in float64 (rounding of another
    summation order only, ~1e-16: rtol 1e-12). Returns the gradients checked and the
    captures after each step (every rank captured again once, together)."""
    case = length_case("llama")
    model, reference = case.model(), case.model().double()
    pipe = Pipe(model, example_inputs=case.inputs, chunks=4, schedule=schedule,
                split_points=[case.blocks[2]])
    pipe.to(torch.float64)
    checked, captures = 0, []
    for seed, length in enumerate([12, 7]):
        inputs, labels = batch("llama", length, seed=seed + 1)
        checked += _step_equal(pipe, model, reference, inputs, labels, f"float64/{length}",
                               {"rtol": 1e-12, "atol": 1e-14})
        captures.append(pipe._io.captures)
    pipe.close()
    return {"checked": checked, "captures": captures}
