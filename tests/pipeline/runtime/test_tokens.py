"""Token micro-batches (pipeline/runtime/tokens.py): exact against the unsplit model on the padded
batch, rows back in order, the grouping and its order, and every refusal with its reason."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import schedules
from pipeline import Pipe, PipeConfigError
from pipeline.runtime import tokens
from tests.pipeline.tokens_workers import (
    HF_TOL,
    TOL,
    assert_same,
    llama,
    masked_lm,
    padded_batch,
    token_loss,
)

LENGTHS = [11, 2, 5, 9, 3, 7, 1, 4, 12, 6]


def _count(target: torch.Tensor) -> torch.Tensor:
    return (target != -100).sum()


@pytest.mark.parametrize(("schedule", "checkpoint"), [("1f1b", "except_last"),
                                                      ("gpipe", "always"),
                                                      ("zb-h1", "never"),
                                                      ("interleaved", "except_last")])
def test_exact_against_the_unsplit_model_on_the_padded_batch(schedule: str,
                                                             checkpoint: str) -> None:
    model = masked_lm(blocks=4 if schedule == "interleaved" else 3)
    reference = copy.deepcopy(model)
    balance = [2, 1, 2, 1] if schedule == "interleaved" else [3, 2]
    pipe = Pipe(model, balance=balance, chunks=4, schedule=schedule, checkpoint=checkpoint,
                tokens=True)
    for seed in range(2):  # accumulating, as the plain model's backward does
        ids, mask, labels = padded_batch(LENGTHS, 14, seed=seed)
        loss = pipe.step((ids, mask), labels, token_loss, loss_weight=_count)
        expected = token_loss(reference((ids, mask)), labels)
        expected.backward()
        assert assert_same(model, reference, loss, expected, schedule) == len(list(
            model.parameters()))


def test_the_keyword_on_step_and_the_losses_pipe_counts_itself() -> None:
    """`tokens=` on a step of a Pipe built without it; nn.CrossEntropyLoss needs no weight."""
    model = masked_lm()
    reference = copy.deepcopy(model)
    pipe = Pipe(model, balance=[3, 2], chunks=3)
    ids, mask, labels = padded_batch(LENGTHS)
    loss_fn = nn.CrossEntropyLoss()

    def flat(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(out.flatten(0, 1), target.flatten())

    pipe.step((ids, mask), labels, flat, loss_weight=_count, tokens=True)
    lengths = mask.sum(1)
    loss = pipe.step((ids, mask), labels, flat, loss_weight=_count, tokens=lengths)
    expected = flat(reference((ids, mask)), labels)
    (2 * expected).backward()  # two steps accumulated
    assert_same(model, reference, 2 * loss, 2 * expected, "tokens on step")


def test_outputs_come_back_in_the_callers_row_order_and_shape() -> None:
    model = masked_lm()
    pipe = Pipe(copy.deepcopy(model), balance=[3, 2], chunks=4, tokens=True)
    ids, mask, _ = padded_batch(LENGTHS, 14)
    with torch.no_grad():
        out, expected = pipe((ids, mask)), model((ids, mask))
    assert out.shape == expected.shape
    kept = mask.bool()
    torch.testing.assert_close(out[kept], expected[kept], **TOL)
    # Beyond each micro-batch's longest row nothing was computed: zeros there.
    assert bool((out[:, 12:] == 0).all())  # no row reaches past 12 tokens


def test_a_split_llama_with_its_own_loss_is_exact_and_infers_in_order() -> None:
    pytest.importorskip("transformers")
    model, reference = llama(), llama()
    ids, mask, labels = padded_batch([12, 3, 5, 9, 2, 7], 14)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}
    pipe = Pipe(model, example_inputs=inputs, split_points=["model.layers.2"], chunks=3,
                tokens=True)
    loss = pipe.step(inputs, None, lambda out, y: out.loss)
    expected = reference(**inputs).loss
    expected.backward()
    assert assert_same(model, reference, loss, expected, "llama", HF_TOL) > 0
    model.eval()
    reference.eval()
    with torch.no_grad():
        out, want = pipe(inputs), reference(**inputs)
    kept = mask.bool()
    torch.testing.assert_close(out.logits[kept], want.logits[kept], **TOL)
    torch.testing.assert_close(out.loss, want.loss, **HF_TOL)


def test_rows_are_grouped_longest_first_minimising_the_costliest_micro_batch() -> None:
    lengths = [12, 2, 5, 9, 3, 7, 1, 4]
    groups = tokens.group(lengths, 3)
    assert groups == [[0, 3], [5, 2, 7], [4, 1, 6]]  # costs 24, 21, 9 (rows x longest)
    assert sorted(r for g in groups for r in g) == list(range(8))
    # Exhaustive over contiguous groupings of the sorted rows: none has a cheaper largest.
    ordered = sorted(lengths, reverse=True)
    best = min(max(ordered[0] * a, ordered[a] * (b - a), ordered[b] * (8 - b))
               for a in range(1, 7) for b in range(a + 1, 8))
    assert max(len(g) * max(lengths[r] for r in g) for g in groups) == best
    assert tokens.group([4, 4, 4, 4], 4) == [[0], [1], [2], [3]]


def test_the_run_order_is_the_simulators_fastest() -> None:
    program = schedules.get_schedule("1f1b", 2, 3)
    costs = [5.0, 1.0, 3.0]
    chosen = tokens.order(costs, program)
    assert sorted(chosen) == [0, 1, 2]

    def makespan(order: list[int]) -> float:
        scale = [costs[k] / 5 for k in order]
        return schedules.simulate(program, schedules.Costs(microbatch=scale)).makespan

    assert makespan(chosen) == min(makespan(o) for o in ([0, 2, 1], [1, 2, 0], [0, 1, 2]))


def test_the_simulator_takes_per_micro_batch_costs() -> None:
    program = schedules.get_schedule("gpipe", 2, 2)
    even = schedules.simulate(program).makespan
    uneven = schedules.simulate(program, schedules.Costs(microbatch=(2.0, 1.0))).makespan
    assert uneven > even
    parsed = schedules.Costs.parse("F=1,B=2,mb=2/1")
    assert parsed.microbatch == (2.0, 1.0)
    assert schedules.simulate(program, parsed).makespan == uneven
    with pytest.raises(ValueError, match="mb="):
        schedules.Costs.parse("mb=2/x")


def _refused(pipe: Pipe, x: object, target: object, match: str) -> None:
    before = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(PipeConfigError, match=match):
        pipe.step(x, target, token_loss, loss_weight=_count)
    assert all(p.grad is None for p in pipe.parameters())  # before any work
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters(), strict=True))


def test_refused_with_batch_norm_rows_are_not_independent() -> None:
    model = masked_lm()

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(13).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x.transpose(1, 2)).transpose(1, 2)

    model.append(Norm())
    ids, mask, labels = padded_batch(LENGTHS)
    _refused(Pipe(model, balance=[3, 3], chunks=2, tokens=True), (ids, mask), labels,
             "BatchNorm .*statistics mix rows")


def test_refused_where_padding_is_not_trailing() -> None:
    ids, mask, labels = padded_batch(LENGTHS)
    left = mask.flip(1)  # left padding
    _refused(Pipe(masked_lm(), balance=[3, 2], chunks=2, tokens=True), (ids, left), labels,
             r"row 0's attention mask is 0 at position 0 and 1 at 1 .*padding_side='right'")


def test_refused_where_lengths_disagree_with_the_mask() -> None:
    ids, mask, labels = padded_batch(LENGTHS)
    lengths = mask.sum(1)
    lengths[3] += 1
    pipe = Pipe(masked_lm(), balance=[3, 2], chunks=2)
    with pytest.raises(PipeConfigError, match="disagrees with the attention mask on row 3: "
                                              "length 10, but the mask counts 9"):
        pipe.step((ids, mask), labels, token_loss, loss_weight=_count, tokens=lengths)
    with pytest.raises(PipeConfigError, match="one length per row: got 9 for 10 rows"):
        pipe.step((ids, mask), labels, token_loss, loss_weight=_count, tokens=lengths[:9])
    assert all(p.grad is None for p in pipe.parameters())


def test_refused_where_padding_is_counted_or_there_is_no_mask() -> None:
    ids, mask, labels = padded_batch(LENGTHS)
    counted = labels.clone()
    counted[1, 6] = 3  # row 1 has 2 tokens: position 6 would be cut away
    pipe = Pipe(masked_lm(), balance=[3, 2], chunks=2, tokens=True)
    _refused(pipe, (ids, mask), counted, "counts a token on row 1's padding")
    _refused(pipe, (ids,), labels, "the input has none .* pass tokens=lengths")
    grad = (ids, mask, torch.zeros(len(LENGTHS), 1, requires_grad=True))
    _refused(pipe, grad, labels, "require grad")


def test_refused_in_inference_too() -> None:
    ids, mask, _ = padded_batch(LENGTHS)
    pipe = Pipe(masked_lm(), balance=[3, 2], chunks=2, tokens=True)
    with pytest.raises(PipeConfigError, match="left padding"):
        pipe((ids, mask.flip(1)))
