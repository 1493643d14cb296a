"""Batches of any length: each batch checked against the captured graphs before any work, the
model captured again for shapes none of them takes, or the batch refused with the reason.

Export keeps most sizes symbolic (pipeline/splitting/shapes.py), so a Hugging Face model's one
capture takes every length. A model whose code fixes a size, or branches on one, is captured
again at the new shapes (once per shape family: the capture's graphs take every shape their
limits allow), and its stages then run whichever capture their values fit. A dtype changed
after the split (`pipe.to(torch.bfloat16)`) is a new signature too: the model is captured again
in it (pipeline/splitting/dtypes.py), once per dtype, and the stages run only the captures made
in the dtypes they hold. Under several processes every rank captures alike: the ranks exchange
the batch's shapes (a rank may pass None for inputs it does not need) and their stages' dtypes
first, and all refuse, or all capture, together.
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
from pipeline.splitting import dtypes, trace
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
Reason = Misfit | dtypes.DtypeChange  # why a capture is made


class Lengths:
    """A split model's captures (their limits, per mode, and the dtypes each was made in) and
    the batch signatures already seen to fit one; `captures` counts them (1: the first capture
    took every batch)."""

    def __init__(self, split: Any, limits: dict[str, Limits]) -> None:
        self._split = split
        self._limits = [limits]
        self._base = dtypes.dtypes_of(split)  # the first capture's, by the model's names
        self._dtypes: list[dtypes.Changes] = [{}]  # per capture: its changes from the base
        self._fits: dict[str, int] = {}  # shapes and dtypes -> the capture they fit
        self.exchange: Exchange | None = None  # several processes: every rank's payload

    @property
    def captures(self) -> int:
        """How many times the model was captured (once, plus once per new shape family or
        dtype)."""
        return len(self._limits)

    def admit(self, tensors: Sequence[Any] | None) -> None:
        """Before any work: `tensors` (the model's tensor inputs; None on a rank without the
        first stage) fit a capture made in the model's dtypes now, or one is made for them,
        or a PipeConfigError says why not (the input, the dimension, the size, what the model
        takes, what to do; or the dtype)."""
        shapes: Any = None if tensors is None else [
            [list(t.shape), str(t.dtype).removeprefix("torch.")]
            if isinstance(t, torch.Tensor) else None for t in tensors]
        changed = dtypes.changes(self._split, self._base)
        # Positions counted from the inputs' values (OPT's mask, RoBERTa's ids): every batch.
        reads = None if tensors is None else [
            r for mode in MODES for r in self._limits[0][mode].reads(tensors)]
        if self.exchange is not None:
            shapes, changed, reads = self._agreed(shapes, changed, reads)
        self._use(changed)
        if shapes is None:
            return
        stand_ins = [None if s is None else _stand_in(s[0], s[1]) for s in shapes]
        past = self._overread(stand_ins, reads)
        if past is not None:
            raise _refusal(past, _TABLE)
        key = json.dumps([shapes, sorted(changed.items())])
        if key in self._fits:
            return
        mine = [k for k, d in enumerate(self._dtypes) if d == changed]
        misfits = {k: self._misfit(k, stand_ins) for k in mine or [0]}
        fitting = [k for k, m in misfits.items() if m is None and k in mine]
        if fitting:
            self._fits[key] = fitting[-1]
            return
        first = misfits[min(misfits)]
        if first is not None and first.table:
            raise _refusal(first, _TABLE)
        if first is not None and first.shared:
            raise _refusal(first, "the graph computes with both")
        reason = first if mine else dtypes.DtypeChange.of(changed, self._base)
        assert reason is not None
        self._capture(stand_ins, reason, changed)
        self._fits[key] = len(self._limits) - 1
        self._use(changed)

    def _use(self, changed: dtypes.Changes) -> None:
        """The stages run only the captures made in the model's dtypes now."""
        usable = frozenset(k for k, d in enumerate(self._dtypes) if d == changed)
        for stage in self._split:
            if hasattr(stage, "use"):
                stage.use(usable)

    def _misfit(self, k: int, tensors: Sequence[Any]) -> Misfit | None:
        for mode in MODES:
            found = self._limits[k][mode].misfit(tensors)
            if found is not None:
                return found
        return None

    def _overread(self, tensors: Sequence[Any], reads: Sequence[int | None] | None
                  ) -> Misfit | None:
        """The first table the batch (`tensors`: of its shapes) reads past, by `reads`."""
        if not reads:
            return None
        at = 0
        for mode in MODES:
            limits = self._limits[0][mode]
            count = sum(table.values for table in limits.tables)
            past = limits.overread(tensors, reads[at:at + count])
            if past is not None:
                return past
            at += count
        return None

    def _agreed(self, shapes: Any, changed: dtypes.Changes, reads: list[int | None] | None
                ) -> tuple[Any, dtypes.Changes, list[int | None] | None]:
        """The batch's shapes as the ranks holding it give them, the dtypes every rank's
        stages hold (each converted its own), and the largest positions the ranks holding
        the batch counted from its values, on every rank."""
        assert self.exchange is not None
        given = [json.loads(text) for text in self.exchange(json.dumps([shapes, changed,
                                                                        reads]))]
        texts = {json.dumps(s) for s, _, _ in given if s is not None}
        if len(texts) > 1:
            raise PipeConfigError(
                f"ranks passed inputs of different shapes ({'; '.join(sorted(texts))}): "
                f"every rank passing the inputs must pass the same batch")
        counted = [r for _, _, r in given if r is not None]
        largest = [max((x for x in column if x is not None), default=None)
                   for column in zip(*counted, strict=True)] if counted else None
        return ((json.loads(texts.pop()) if texts else None),
                dtypes.merged([c for _, c, _ in given]), largest)

    def _capture(self, tensors: list[Any], reason: Reason, changed: dtypes.Changes) -> None:
        """Capture the model again at these shapes, in the dtypes `changed` gives, and give
        every stage its graphs."""
        split = self._split
        stages = list(split)
        model = stages[0].__dict__["_model"]
        held = [*model.parameters(), *model.buffers()] if model is not None else []
        if model is None or any(t.is_meta for t in held) or len({t.device for t in held}) > 1:
            raise _refusal(reason, "capturing it again needs the whole model on one device "
                                   "in this process, and it is not")
        leaves, it = [], iter(tensors)
        for i in range(split.in_spec.num_leaves):
            leaves.append(split.constants[i] if i in split.constants else next(it))
        args, kwargs = pytree.tree_unflatten(leaves, split.in_spec)
        device = held[0].device if held else torch.device("cpu")
        args, kwargs = pytree.tree_map(
            lambda t: t.contiguous().to(device) if isinstance(t, torch.Tensor) else t,
            (tuple(args), dict(kwargs)))
        with dtypes.holding(model, stages, changed):
            programs = self._export(model, args, kwargs, reason)
            rows = self._limits[0]["train"].rows
            limits = {mode: model_limits(ep, rows) for mode, ep in programs.items()}
            for ep in programs.values():  # the weights of 0-dim outputs, as the first capture
                plan(ep.graph, [node for node, _, tensor in cutting.user_inputs(ep)
                                if tensor and node.meta["val"].dim() > 0])
            pieces = {m: cutting.cut(ep, model, split.split_points)
                      for m, ep in programs.items()}
        for s, stage in enumerate(stages):
            # Every name a stage holds a tensor by: a tied weight is held under each of its
            # names (OPT's embedding is `lm_head.weight` too), and a capture may read either.
            have = {n for n, _ in [*stage.named_parameters(remove_duplicate=False),
                                   *stage.named_buffers(remove_duplicate=False)]}
            missing = [n for m in MODES for n in pieces[m][s].tensors if n not in have]
            if missing:
                raise _refusal(reason, f"captured again, stage {s} would read {missing[:3]}, "
                                       f"which it does not hold")
        for s, stage in enumerate(stages):
            stage.add_variant({m: pieces[m][s] for m in MODES},
                              {m: stage_limits(programs[m], pieces[m][s]) for m in MODES})
        self._limits.append(limits)
        self._dtypes.append(dict(changed))
        _log.info("captured %s again for %s (%d captures)", type(model).__name__, reason,
                  self.captures)

    def _export(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                reason: Reason) -> dict[str, torch.export.ExportedProgram]:
        """Both modes' graphs of the model, outlined as the first capture's."""
        split = self._split
        try:
            programs = {mode: trace.export(model, args, kwargs, train=mode == "train",
                                           preserve=split.whole) for mode in MODES}
        except trace.ExportError as exc:
            said = str(exc).split(". Pipe splits a model")[0]  # not the advice on rewriting
            how = ("at these shapes" if isinstance(reason, Misfit) else
                   f"in {', '.join(reason.dtypes)}")
            raise _refusal(reason, f"captured again {how}, the model fails ({said})"
                           ) from None
        for ep in programs.values():
            outline(ep, model, split.whole)
        return programs


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


_TABLE = ("no capture can lift that: the model reads a table of fixed size at positions "
          "computed from its inputs (a learned or rotary position table)")


def _refusal(reason: Reason, why: str) -> PipeConfigError:
    if isinstance(reason, dtypes.DtypeChange):
        fix = reason.fix
    elif reason.table:
        fix = ("truncate longer sequences to the model's maximum length (its config's "
               "max_position_embeddings or n_positions, where it has one)")
    elif reason.shared:
        fix = "pass inputs whose sizes agree, as the model needs"
    else:
        fix = ("pass batches the model takes there (truncate longer sequences, or pad "
               "shorter ones to a size it takes)")
    return PipeConfigError(f"{reason}, and {why}: {fix}. Nothing was computed")
