"""`split`: any model into pipeline stages at module boundaries, from its exported graph."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from pipeline.errors import PipeConfigError
from pipeline.splitting import cut as cutting
from pipeline.splitting import lengths, trace
from pipeline.splitting.outline import outline
from pipeline.splitting.placing import place_tensors
from pipeline.splitting.positions import Positions
from pipeline.splitting.scalars import Scalars, plan
from pipeline.splitting.traced import MODES, SplitModel, TracedStage

__all__ = ["Agree", "block_points", "split"]


Agree = Callable[[Callable[[], list[int]]], list[int]]


def split(model: nn.Module, example_inputs: Any, *, split_points: Sequence[str] | None = None,
          stages: int | None = None, balance: str = "params",
          agree: Agree | None = None, keep_whole: Sequence[str] = ()) -> SplitModel:
    """Split `model` into stages at module boundaries: before each module named in
    `split_points` (names from `model.named_modules()`, in the order they run), or into
    `stages` parts at the model's repeated blocks, balanced by `balance` ("params",
    "uniform", "time" or "size", as Pipe's balance). `example_inputs` is what the model is
    called with (a tensor, a tuple of arguments, a dict of keyword arguments, or a pair
    (args, kwargs)); it may live on the meta device, with the model. Returns an
    nn.Sequential of stages to inspect or pass to Pipe; its tensors are the model's own
    objects. `agree` (Pipe's, over processes) makes every rank take rank 0's profiled
    split. Modules named in `keep_whole` run as modules (their own forward, hooks and
    all) rather than as their traced ops: what tensor parallelism needs (Pipe chooses
    them from its `tp_plan`; see pipeline/splitting/outline.py)."""
    if (split_points is None) == (stages is None):
        raise PipeConfigError("give split points (split_points=['model.layers.2', ...]) or "
                              "a stage count (stages=N), not both and not neither")
    args, kwargs = trace.check_example(example_inputs)
    keep_whole = list(keep_whole)
    for name in keep_whole:
        if name not in dict(model.named_modules()) or not name:
            raise PipeConfigError(f"keep_whole names modules of the model; {name!r} is not "
                                  f"one")
    programs = {mode: trace.export(model, args, kwargs, train=mode == "train",
                                   preserve=keep_whole)
                for mode in MODES}
    for ep in programs.values():
        outline(ep, model, keep_whole)
    scalars = {mode: plan(ep.graph, [node for node, _, tensor in cutting.user_inputs(ep)
                                     if tensor and node.meta["val"].dim() > 0])
               for mode, ep in programs.items()}
    if split_points is None:
        assert stages is not None
        split_points = _choose(model, programs["train"], (args, kwargs), stages, balance,
                               agree, scalars["train"])
    inside = [p for p in split_points if any(p.startswith(w + ".") for w in keep_whole)]
    if inside:
        raise PipeConfigError(f"split points {inside} lie inside modules kept whole "
                              f"({keep_whole}): a stage cannot begin inside a module call")
    split = _build(model, programs, split_points, scalars)
    split.whole = tuple(keep_whole)
    return split


def _build(model: nn.Module, programs: dict[str, Any], split_points: Sequence[str],
           scalars: dict[str, Scalars]) -> SplitModel:
    pieces = {mode: cutting.cut(ep, model, split_points) for mode, ep in programs.items()}
    num = len(split_points) + 1
    stages = [TracedStage(s, {m: pieces[m][s] for m in MODES}, model) for s in range(num)]
    used = [set(itertools.chain.from_iterable(pieces[m][s].tensors for m in MODES))
            for s in range(num)]
    place_tensors(model, stages, used)
    for s, stage in enumerate(stages):
        stage.compile({m: lengths.stage_limits(programs[m], pieces[m][s]) for m in MODES})
    train = programs["train"]
    in_spec = train.call_spec.in_spec
    constants = {i: value for i, (_, value, tensor) in enumerate(cutting.user_inputs(train))
                 if not tensor}
    split = SplitModel(stages, in_spec, {m: programs[m].call_spec.out_spec for m in MODES},
                       constants, split_points, scalars)
    split.positions = {m: Positions.of(programs[m], scalars[m].num_leaves) for m in MODES}
    tensors = [node for node, _, tensor in cutting.user_inputs(train) if tensor]
    split.input_names = [node.name for node in tensors]
    # Export fixes a dim 0 of 1 (broadcast over the batch: position_ids (1, T)): such an
    # input goes whole to every micro-batch, and must keep its one row.
    split.broadcast = frozenset(i for i, node in enumerate(tensors)
                                if node.meta["val"].dim() > 0
                                and isinstance(node.meta["val"].shape[0], int)
                                and node.meta["val"].shape[0] == 1)
    rows = frozenset(i for i, node in enumerate(tensors)
                     if node.meta["val"].dim() > 0 and i not in split.broadcast)
    split.lengths = lengths.Lengths(
        split, {m: lengths.model_limits(programs[m], rows) for m in MODES})
    return split


def block_points(model: nn.Module, ep: Any) -> list[str]:
    """The model's repeated blocks in run order (the children of its largest ModuleList or
    Sequential that run): where an automatic split may begin a stage."""
    order = cutting.module_order(ep)
    groups: dict[str, list[str]] = {}
    for name in order:
        parent, _, last = name.rpartition(".")
        if last.isdigit() and isinstance(model.get_submodule(parent) if parent else model,
                                         nn.ModuleList | nn.Sequential):
            groups.setdefault(parent, []).append(name)
    if not groups:
        raise PipeConfigError(
            f"{type(model).__name__} has no ModuleList or Sequential of blocks to split "
            f"between automatically: give split_points=[module names] (e.g. "
            f"{order[1:3]})")
    blocks = max(groups.values(), key=len)
    return blocks


def _choose(model: nn.Module, ep: Any, example: tuple[Any, Any], stages: int,
            balance: str, agree: Agree | None, scalars: Scalars) -> list[str]:
    """Split points for `stages` stages: cut at every block, balance the pieces as Pipe
    balances layers, keep the cuts between stages."""
    from pipeline.splitting.config import balance_layers  # config imports this module

    points = block_points(model, ep)[1:]  # the first block's stage starts with the model
    if stages < 1 or stages > len(points) + 1:
        raise PipeConfigError(
            f"stages must be between 1 and {len(points) + 1} (the model has "
            f"{len(points) + 1} blocks to split between), got {stages}")
    if stages == 1:
        return []
    fine = _build(model, {m: ep for m in MODES}, points, {m: scalars for m in MODES})

    def sizes() -> list[int]:
        return balance_layers(fine, balance, stages, fine.flatten(example))
    chosen = agree(sizes) if agree is not None and balance in ("time", "size") else sizes()
    return [points[b - 1] for b in list(itertools.accumulate(chosen))[:-1]]
