"""What a token micro-batch costs, fitted from the measured timelines of earlier steps.

Token micro-batches differ in cost, and the order they run in changes the step (the simulator
times each candidate order, `tokens.order`). Rows x trimmed length is a first guess; the
measured cost is what the ranks took: each step's timeline gives every micro-batch's compute
(forward; backward, or its input and weight halves) on this process's ranks, and a least-squares
fit of time = a + b * tokens + c * tokens * length (attention's quadratic term) on the last
steps' micro-batches predicts the next step's. Over processes each rank measures only its own
stages: the ranks add their fits through one small exchange per step, so every rank orders the
micro-batches the same way (the first and the last stage must: both cut the batch).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from schedules import Op, Timeline

__all__ = ["TokenCosts"]

_KEEP = 256  # micro-batches kept per fit: the last steps', as shapes and load drift
_BACKWARD = (Op.B, Op.I, Op.W)


def _features(rows: int, length: int) -> tuple[float, float, float]:
    tokens = float(rows * max(length, 1))
    return 1.0, tokens, tokens * max(length, 1)


class TokenCosts:
    """Per-micro-batch compute seconds by shape, fitted from measured steps (one per Pipe)."""

    def __init__(self) -> None:
        # (is the step a training step, features) -> seconds; forward-only steps are fitted
        # apart: their micro-batches cost their forward alone.
        self._samples: dict[bool, deque[tuple[tuple[float, ...], float]]] = {
            True: deque(maxlen=_KEEP), False: deque(maxlen=_KEEP)}
        self._own: dict[bool, tuple[float, ...] | None] = {True: None, False: None}
        self.fits = dict(self._own)  # what predicts: over processes, every rank's added

    def record(self, timeline: Timeline, shapes: Sequence[tuple[int, int]],
               chunks: int) -> None:
        """Add a step's measured micro-batches: `shapes[m]` is micro-batch m's (rows, trimmed
        length); the step ran `len(shapes) // chunks` batches of `chunks`."""
        seconds = [0.0] * len(shapes)
        train = False
        for e in timeline.events:
            a = e.action
            if a.op == Op.F or a.op in _BACKWARD:
                if 0 <= a.microbatch < len(shapes):
                    seconds[a.microbatch] += e.end - e.start
                train = train or a.op in _BACKWARD
        if not any(seconds):
            return
        for shape, s in zip(shapes, seconds, strict=True):
            self._samples[train].append((_features(*shape), s))
        self._own[train] = self.fits[train] = _fit(self._samples[train])

    def agree(self, exchange: Callable[[str], list[str]] | None) -> None:
        """Over processes: every rank's fits added (each measured only its own stages)."""
        if exchange is None:
            return
        texts = exchange(json.dumps({str(k): v for k, v in self._own.items()}))
        for train in (True, False):
            fits = [json.loads(t).get(str(train)) for t in texts]
            self.fits[train] = (None if any(f is None for f in fits)
                                else tuple(float(sum(c)) for c in zip(*fits, strict=True)))

    def predict(self, shapes: Sequence[tuple[int, int]], train: bool) -> list[float] | None:
        """Each micro-batch's predicted seconds, or None before a fit exists."""
        fit = self.fits[train]
        if fit is None:
            return None
        return [max(float(np.dot(fit, _features(*s))), 1e-9) for s in shapes]


def _fit(samples: Any) -> tuple[float, ...] | None:
    """Non-negative least squares on (features, seconds): costs never fall as tokens grow.
    With three terms, the best fit over every subset of them whose own least squares is
    non-negative is the exact answer. None: too few distinct shapes."""
    xs = np.array([f for f, _ in samples], dtype=np.float64)
    ys = np.array([s for _, s in samples], dtype=np.float64)
    if len({tuple(r) for r in xs.tolist()}) < 2:
        return None
    best: tuple[float, np.ndarray] | None = None
    for terms in ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (2,), (0,)):
        cols = list(terms)
        coef, *_ = np.linalg.lstsq(xs[:, cols], ys, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        residual = float(np.square(xs @ full - ys).sum())
        if best is None or residual < best[0] - 1e-18:
            best = (residual, full)
    return None if best is None else tuple(float(c) for c in best[1])
