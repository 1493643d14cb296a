"""`step_many` on a model split from its graph: batch after batch, and PipeDream-2BW's
one-step-stale rule over several batches in one schedule."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from pipeline import Pipe
from tests.models_traced import Case, gpt2_case, llama_case, token_count

pytest.importorskip("transformers")

LR = 0.05
# fp32, micro-batch sums in another order than one batch's: rtol 1e-5 (as everywhere else);
# atol 1e-6 for values that are zero in exact arithmetic.
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}


def _batches(case: Case) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Three batches: the case's, and its rows rolled by one and by two."""
    return [({k: v.roll(r, 0) if isinstance(v, torch.Tensor) else v
              for k, v in case.inputs.items()}, case.labels.roll(r, 0)) for r in range(3)]


def test_2bw_many_batches_follow_the_stale_update_rule() -> None:
    """W(t+1) = W(t) - lr * grad f(W(t-1)), with batch t+1 begun before batch t's updates."""
    case = llama_case()  # untied: 2BW runs the batches as one schedule
    model, reference = case.model(), case.model()
    data = _batches(case)
    previous = copy.deepcopy(reference)
    expected = []
    for inputs, labels in data:
        stale = copy.deepcopy(previous)  # W(t-1)
        loss = case.loss(stale(**inputs), labels)
        loss.backward()
        expected.append(loss.detach())
        previous = copy.deepcopy(reference)  # W(t), before its update
        with torch.no_grad():
            for p, q in zip(reference.parameters(), stale.parameters(), strict=True):
                p.sub_(LR * q.grad)
    pipe = Pipe(model, example_inputs=case.inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4, schedule="2bw", checkpoint="except_last")
    assert pipe.multi_batch
    losses = pipe.step_many(data, case.loss, torch.optim.SGD(model.parameters(), lr=LR),
                            loss_weight=token_count)
    for got, want in zip(losses, expected, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    events = {str(e.action): e.start for e in pipe.last_timeline().events}
    # One schedule: rank 0 began batch 1 before its update for batch 0 (its own order).
    assert events["0F4v1"] < events["0U0"]
    pipe.close()


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_step_many_on_a_tied_model_is_step_then_optimizer(schedule: str) -> None:
    """GPT-2's tied head: 1f1b's step_many equals plain training batch after batch; 2BW
    runs batch by batch (a tie's copy would update after its owner inside a flush-free
    schedule), its gradients one step stale: the first batch equals plain training, the
    later ones do not."""
    case = gpt2_case()
    model, reference = case.model(), case.model()
    data = _batches(case)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    expected = []
    for inputs, labels in data:
        optimizer.zero_grad()
        loss = case.loss(reference(**inputs), labels)
        loss.backward()
        optimizer.step()
        expected.append(loss.detach())
    pipe = Pipe(model, example_inputs=case.inputs, split_points=[case.blocks[2]],
                devices=["cpu", "cpu"], chunks=4, schedule=schedule)
    losses = pipe.step_many(data, case.loss, torch.optim.SGD(model.parameters(), lr=LR),
                            loss_weight=token_count)
    if schedule == "1f1b":
        for got, want in zip(losses, expected, strict=True):
            torch.testing.assert_close(got, want, **TOL)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, **TOL)
    else:  # the first batch has no stale weights yet: it equals plain training
        torch.testing.assert_close(losses[0], expected[0], **TOL)
        assert not torch.equal(losses[2], expected[2])  # later ones are one step stale
    pipe.close()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again
