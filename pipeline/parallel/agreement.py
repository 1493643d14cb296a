"""Ranks agree on their configuration before they train: a fingerprint compared across ranks."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from pipeline.comm.process_group import PeerFailure, ProcessTransport
from pipeline.comm.transport import PeerTimeout, PipelineAborted
from pipeline.errors import PipeConfigError, PipelineError
from pipeline.runtime.microbatch import leading_rows
from schedules import Schedule

__all__ = ["Agreement", "fingerprint"]


def _schedule(arg: str | Schedule) -> str:
    if isinstance(arg, str):
        return arg
    digest = hashlib.sha256(repr(arg.actions).encode()).hexdigest()[:12]
    return f"{arg.name} (a Schedule object, actions {digest})"


def _shapes(value: Any) -> list[list[int]] | None:
    if value is None:
        return None
    items = value if isinstance(value, tuple) else (value,)
    return [list(v.shape) for v in items if isinstance(v, torch.Tensor)]


def _combination(pipe: Any, batches: int) -> dict[str, Any]:
    """The configuration a fingerprint is agreed once for: cheap to read at every step."""
    return {"balance": list(pipe.balance), "schedule": _schedule(pipe._schedule_arg),
            "chunks": pipe.chunks, "checkpoint": pipe.checkpoint, "batches per call": batches}


def fingerprint(pipe: Any, pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """What every rank must share: balance, schedule, chunks, checkpoint mode, batches per
    schedule, the model's parameter shapes per layer, and the batch (as far as this rank holds
    it: input shapes, and rows of the input or target)."""
    model = pipe.__dict__["_full_model"]
    x_shapes = [_shapes(x) for x, _ in pairs]
    rows = [leading_rows(x) or leading_rows(t) for x, t in pairs]
    return {
        **_combination(pipe, len(pairs)),
        "parameter shapes per layer": [[list(p.shape) for p in layer.parameters()]
                                       for layer in model],
        "batch rows": None if any(r is None for r in rows) else rows,
        "input shapes": None if any(s is None for s in x_shapes) else x_shapes,
    }


def _disagreement(prints: list[dict[str, Any]]) -> str | None:
    for field in prints[0]:
        values: dict[str, list[int]] = {}
        for rank, p in enumerate(prints):
            if p[field] is not None or field not in ("input shapes", "batch rows"):
                values.setdefault(json.dumps(p[field]), []).append(rank)
        if len(values) > 1:
            seen = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} "
                             f"{', '.join(map(str, ranks))}: {_short(text)}"
                             for text, ranks in values.items())
            return f"ranks disagree on {field} ({seen})"
    return None


def _short(text: str) -> str:
    return text if len(text) <= 120 else text[:117] + "..."


class Agreement:
    """Checks, for one Pipe, that every rank has the same configuration: once per new
    (balance, schedule, chunks, checkpoint, batches) combination, at its first call, with one
    small exchange between the ranks (then cached). No-op in one process."""

    def __init__(self) -> None:
        self._agreed: set[str] = set()

    def check(self, pipe: Any, pairs: list[tuple[Any, Any]]) -> None:
        transport = pipe._executor.transport
        if not isinstance(transport, ProcessTransport):
            return
        # The combination first (cheap): the whole fingerprint walks every parameter, which
        # once agreed would cost every later step for nothing.
        static = json.dumps(_combination(pipe, len(pairs)))
        if static in self._agreed:
            return
        mine = fingerprint(pipe, pairs)
        try:
            texts = transport.exchange(json.dumps(mine))
        except PipelineAborted as exc:
            raise PipelineError(str(exc)) from None
        except (PeerFailure, PeerTimeout) as exc:
            transport.abort(transport.rank, str(exc))
            raise PipelineError(f"while the ranks compared their configuration: {exc}") from None
        problem = _disagreement([json.loads(t) for t in texts])
        if problem is not None:
            raise PipeConfigError(
                f"{problem}. Every rank must build Pipe with the same model, balance, schedule, "
                f"chunks and checkpoint, and call it with batches of the same size")
        self._agreed.add(static)
