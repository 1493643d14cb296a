"""Batches of any length: each batch checked against the captured graphs before any work, the
model captured again for shapes none of them takes, or the batch refused with the reason.

Export keeps most sizes symbolic (pipeline/splitting/shapes.py), so a Hugging Face model's one
capture takes every length. A model whose code fixes a size, or branches on one, is captured
again at the new shapes (once per shape family: the capture's graphs take every shape their
limits allow), and its stages then run whichever capture their values fit. Under several
processes every rank captures alike: the ranks exchange the batch's shapes first (a rank may
pass None for inputs it does not need), and all refuse, or all capture, together.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeline.errors import PipeConfigError
from pipeline.splitting import cut as cutting
from pipeline.splitting import trace
from pipeline.splitting.outline import outline
from pipeline.splitting.scalars import plan
from pipeline.splitting.shapes import Limits, Misfit

__all__ = ["Lengths", "connect", "model_limits", "stage_limits"]

_log = logging.getLogger("pipeline")
MODES = ("train", "eval")


def model_limits(ep: torch.export.ExportedProgram, rows: frozenset[int]) -> Limits:
    """What the model's tensor inputs may be for the graph `ep` (`rows`: inputs split into
    micro-batches)."""
    nodes = [node for node, _, tensor in cutting.user_inputs(ep) if tensor]
    sig = ep.graph_signature
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    return Limits.of(nodes, ep.range_constraints, rows, ep.graph, names)


def stage_limits(ep: torch.export.ExportedProgram, piece: cutting.Piece) -> Limits:
    """What the values crossing into one stage of `ep` may be."""
    nodes = [n for n in piece.graph.nodes if n.op == "placeholder"]
    return Limits.of(nodes, ep.range_constraints, frozenset())


Exchange = Callable[[str], list[str]]


class Lengths:
    """A split model's captures (their limits, per mode) and the shape signatures already
    seen to fit one; `captures` counts them (1: the first capture took every batch)."""

    def __init__(self, split: Any, limits: dict[str, Limits]) -> None:
        self._split = split
        self._limits = [limits]
        self._fits: dict[str, int] = {}  # shape signature -> the capture it fits
        self.exchange: Exchange | None = None  # several processes: every rank's payload

    @property
    def captures(self) -> int:
        """How many times the model was captured (once, plus once per new shape family)."""
        return len(self._limits)

    def admit(self, tensors: Sequence[Any] | None) -> None:
        """Before any work: `tensors` (the model's tensor inputs; None on a rank without the
        first stage) fit a capture, or one is made for them, or a PipeConfigError says why
        not (the input, the dimension, the size, what the model takes, what to do)."""
        shapes: Any = None if tensors is None else [
            [list(t.shape), str(t.dtype).removeprefix("torch.")]
            if isinstance(t, torch.Tensor) else None for t in tensors]
        key = json.dumps(shapes)
        if self.exchange is not None:
            key = self._agreed(key)
            shapes = json.loads(key)
        if shapes is None or key in self._fits:
            return
        stand_ins = [None if s is None else _stand_in(s[0], s[1]) for s in shapes]
        misfits = [self._misfit(k, stand_ins) for k in range(len(self._limits))]
        fitting = [k for k, m in enumerate(misfits) if m is None]
        if fitting:
            self._fits[key] = fitting[-1]
            return
        first = misfits[0]
        assert first is not None
        if first.table:
            raise _refusal(first, "no capture can lift that: the model reads a learned "
                                  "position table there")
        if first.shared:
            raise _refusal(first, "the graph computes with both")
        self._capture(stand_ins, first)
        self._fits[key] = len(self._limits) - 1

    def _misfit(self, k: int, tensors: Sequence[Any]) -> Misfit | None:
        for mode in MODES:
            found = self._limits[k][mode].misfit(tensors)
            if found is not None:
                return found
        return None

    def _agreed(self, mine: str) -> str:
        """The batch's shapes as the ranks holding it give them, on every rank."""
        assert self.exchange is not None
        given = {text for text in self.exchange(mine) if text != "null"}
        if len(given) > 1:
            raise PipeConfigError(
                f"ranks passed inputs of different shapes ({'; '.join(sorted(given))}): "
                f"every rank passing the inputs must pass the same batch")
        return given.pop() if given else "null"

    def _capture(self, tensors: list[Any], misfit: Misfit) -> None:
        """Capture the model again at these shapes and give every stage its graphs."""
        split = self._split
        stages = list(split)
        model = stages[0].__dict__["_model"]
        held = [*model.parameters(), *model.buffers()] if model is not None else []
        if model is None or any(t.is_meta for t in held) or len({t.device for t in held}) > 1:
            raise _refusal(misfit, "capturing it again needs the whole model on one device "
                                   "in this process, and it is not")
        leaves, it = [], iter(tensors)
        for i in range(split.in_spec.num_leaves):
            leaves.append(split.constants[i] if i in split.constants else next(it))
        args, kwargs = pytree.tree_unflatten(leaves, split.in_spec)
        device = held[0].device if held else torch.device("cpu")
        args, kwargs = pytree.tree_map(
            lambda t: t.contiguous().to(device) if isinstance(t, torch.Tensor) else t,
            (tuple(args), dict(kwargs)))
        try:
            programs = {mode: trace.export(model, args, kwargs, train=mode == "train",
                                           preserve=split.whole) for mode in MODES}
        except trace.ExportError as exc:
            said = str(exc).split(". Pipe splits a model")[0]  # not the advice on rewriting
            raise _refusal(misfit, f"captured again at these shapes, the model fails ({said})"
                           ) from None
        for ep in programs.values():
            outline(ep, model, split.whole)
        rows = self._limits[0]["train"].rows
        limits = {mode: model_limits(ep, rows) for mode, ep in programs.items()}
        for ep in programs.values():  # the weights of 0-dim outputs, as the first capture
            plan(ep.graph, [node for node, _, tensor in cutting.user_inputs(ep)
                            if tensor and node.meta["val"].dim() > 0])
        pieces = {m: cutting.cut(ep, model, split.split_points) for m, ep in programs.items()}
        for s, stage in enumerate(stages):
            have = {n for n, _ in [*stage.named_parameters(), *stage.named_buffers()]}
            missing = [n for m in MODES for n in pieces[m][s].tensors if n not in have]
            if missing:
                raise _refusal(misfit, f"captured again, stage {s} would read {missing[:3]}, "
                                       f"which it does not hold")
        for s, stage in enumerate(stages):
            stage.add_variant({m: pieces[m][s] for m in MODES},
                              {m: stage_limits(programs[m], pieces[m][s]) for m in MODES})
        self._limits.append(limits)
        _log.info("captured %s again for %s (%d captures)", type(model).__name__, misfit,
                  self.captures)


def _stand_in(shape: list[int], dtype: str) -> torch.Tensor:
    """A tensor of `shape` and `dtype` holding one element (an expanded zero): what export
    and the limits read of a batch is its shape, and a rank without the batch has only that."""
    kind = getattr(torch, dtype)
    assert isinstance(kind, torch.dtype), dtype
    return torch.zeros((), dtype=kind).expand(shape)


def connect(split: Any, transport: Any) -> None:
    """Several processes: `split`'s ranks exchange each batch's shapes over `transport`
    before any work (a few bytes per step), so all capture, or all refuse, together."""
    from pipeline.comm.process_group import PeerFailure, ProcessTransport
    from pipeline.comm.transport import PeerTimeout, PipelineAborted
    from pipeline.errors import PipelineError

    if getattr(split, "lengths", None) is None or not isinstance(transport, ProcessTransport):
        return

    def exchange(payload: str) -> list[str]:
        try:
            return transport.exchange(payload)
        except PipelineAborted as exc:
            raise PipelineError(str(exc)) from None
        except (PeerFailure, PeerTimeout) as exc:
            transport.abort(transport.rank, str(exc))
            raise PipelineError(f"while the ranks compared the batch's shapes: {exc}"
                                ) from None
    split.lengths.exchange = exchange


def _refusal(misfit: Misfit, why: str) -> PipeConfigError:
    fix = ("pass batches the model takes there (truncate longer sequences, or pad shorter "
           "ones to a size it takes)")
    if misfit.shared:
        fix = "pass inputs whose sizes agree, as the model needs"
    return PipeConfigError(f"{misfit}, and {why}: {fix}. Nothing was computed")
