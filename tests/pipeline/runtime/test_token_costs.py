"""Token micro-batches ordered by measured cost: the fit recovers known per-shape costs from a
timeline, forward-only steps apart, coefficients stay >= 0, ranks add their fits, and a Pipe's
later steps order their micro-batches by the costs its earlier steps measured."""

from __future__ import annotations

import json

import pytest

from pipeline import Pipe
from pipeline.runtime import tokens
from pipeline.runtime.token_costs import TokenCosts
from schedules import Action, Event, Op, Timeline
from tests.pipeline.tokens_workers import masked_lm, padded_batch, token_loss

A, B, C = 2e-4, 3e-7, 5e-9  # seconds: per micro-batch, per token, per token x length


def _seconds(rows: int, length: int, c: float = C) -> float:
    return A + B * rows * length + c * rows * length * length


def _timeline(shapes: list[tuple[int, int]], train: bool = True, c: float = C) -> Timeline:
    """Two ranks; each micro-batch's compute split over its ops as a step records it."""
    events, t = [], 0.0
    for m, shape in enumerate(shapes):
        total = _seconds(*shape, c=c)
        ops = [(0, Op.F, 0.25), (1, Op.F, 0.25), (1, Op.B, 0.3), (0, Op.B, 0.2)] if train \
            else [(0, Op.F, 0.5), (1, Op.F, 0.5)]
        for rank, op, share in ops:
            events.append(Event(rank, Action(rank, op, m), t, t + share * total))
            events.append(Event(rank, Action(rank, Op.SEND_F, m), t, t + 1.0))  # not compute
            t += share * total
    return Timeline(2, tuple(events), unit="s")


def test_the_fit_recovers_known_costs_from_measured_steps() -> None:
    costs = TokenCosts()
    first, second = [(3, 12), (4, 7), (3, 5)], [(2, 14), (5, 4), (3, 3), (1, 1)]
    costs.record(_timeline(first), first, chunks=3)
    costs.record(_timeline(second), second, chunks=4)
    fit = costs.fits[True]
    assert fit is not None and costs.fits[False] is None  # a forward-only step fits apart
    assert fit == pytest.approx((A, B, C), rel=1e-6)
    assert costs.predict([(6, 20)], train=True) == pytest.approx([_seconds(6, 20)], rel=1e-6)
    assert costs.predict([(6, 20)], train=False) is None  # before any inference step
    costs.record(_timeline(second, train=False), second, chunks=4)
    assert costs.fits[False] == pytest.approx((A, B, C), rel=1e-6)


def test_a_negative_term_is_dropped_and_too_few_shapes_fit_nothing() -> None:
    costs = TokenCosts()
    shapes = [(3, 12), (4, 7), (3, 5), (2, 14)]
    costs.record(_timeline(shapes, c=-1e-9), shapes, chunks=4)  # cheaper per token when long
    fit = costs.fits[True]
    assert fit is not None and fit[2] == 0.0 and min(fit) >= 0
    one = TokenCosts()  # one shape: nothing to fit a slope to
    one.record(_timeline([(2, 5), (2, 5)]), [(2, 5), (2, 5)], chunks=2)
    assert one.fits[True] is None and one.predict([(1, 1)], train=True) is None


def test_ranks_add_their_fits_and_agree() -> None:
    ranks = [TokenCosts(), TokenCosts()]
    shapes = [(3, 12), (4, 7), (3, 5), (2, 14)]
    ranks[0].record(_timeline(shapes), shapes, chunks=4)
    ranks[1].record(_timeline(shapes, c=2 * C), shapes, chunks=4)
    texts = [json.dumps({str(k): v for k, v in r._own.items()}) for r in ranks]
    for r in ranks:
        r.agree(lambda _mine: texts)
        r.agree(lambda _mine: texts)  # again: adds the ranks' own fits, not the sums
    assert ranks[0].fits == ranks[1].fits
    assert ranks[0].fits[True] == pytest.approx((2 * A, 2 * B, 3 * C), rel=1e-6)


def test_later_steps_order_micro_batches_by_the_measured_costs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step orders by rows x length; once a step is measured, each step's order is
    chosen from the fitted seconds of its micro-batches (threads: every rank's events)."""
    seen: list[list[float]] = []
    real = tokens.order
    monkeypatch.setattr(tokens, "order", lambda costs, program: seen.append(list(costs))
                        or real(costs, program))
    pipe = Pipe(masked_lm(), balance=[3, 2], chunks=4, tokens=True)
    for seed, lengths in enumerate([[11, 2, 5, 9, 3, 7, 1, 4], [6, 6, 2, 13, 8, 1, 3, 10],
                                    [4, 9, 12, 2, 2, 7, 5, 1]]):
        ids, mask, labels = padded_batch(lengths, 14, seed=seed)
        pipe.step((ids, mask), labels, token_loss,
                  loss_weight=lambda t: (t != -100).sum())
    measured = pipe._token_costs  # fitted on steps 1 and 2: what step 3 ordered by
    assert all(float(c).is_integer() for c in seen[0])  # rows x length: whole tokens
    lengths = [4, 9, 12, 2, 2, 7, 5, 1]
    shapes = [(len(g), max(2, *(lengths[r] for r in g))) for g in tokens.group(lengths, 4)]
    assert seen[2] == pytest.approx(measured.predict(shapes, train=True), rel=1e-12)
    assert seen[2] != pytest.approx([float(r * n) for r, n in shapes])
