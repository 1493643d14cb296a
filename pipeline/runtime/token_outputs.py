"""`pipe(x)` under token micro-batches: each output put back together by what it is.

Each micro-batch ran trimmed to its own longest row, so its outputs that run along the
positions are shorter than the batch's. Only those are padded back (zeros where nothing was
computed: positions past the micro-batch's longest row, which hold padding), in every dim that
is the positions (attention weights: two). A model split from its graph says which they are
(pipeline/splitting/positions.py): a classifier's logits of 3 labels stay (rows, 3) whatever
the rows' lengths. An nn.Sequential has no graph: an output's dim runs along the positions when
it has each micro-batch's own trimmed length, and `tokens.plan` trims the micro-batches to two
lengths at least (one more position in one of them, where they would all be alike), so a size
that merely equals one length is never taken for the positions. What still cannot be put
together is refused, naming the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from pipeline.errors import PipeConfigError
from pipeline.runtime.microbatch import like
from pipeline.splitting.positions import Layout, refuse

__all__ = ["pad", "reorder"]


def pad(outputs: Sequence[tuple[Any, ...]], groups: Sequence[Sequence[int]],
        lengths: Sequence[int], length: int, layouts: Sequence[Layout] | None
        ) -> list[tuple[Any, ...]]:
    """Each micro-batch's outputs (`groups`: its rows, `lengths`: its trimmed length) with the
    dims along the positions padded back to `length`: the dims `layouts` name per output
    (a graph's), else those that have each micro-batch's own length."""
    if layouts is not None:
        refuse(layouts)
    num = len(outputs[0]) if outputs else 0
    dims = [tuple(layouts[i].pad) if layouts is not None and i < len(layouts)
            else _following(outputs, i, groups, lengths) for i in range(num)]
    padded = []
    for out, n in zip(outputs, lengths, strict=True):
        padded.append(like(out, (_padded(v, dims[i], length - n) if i < len(dims) else v
                                 for i, v in enumerate(out))))
    for i in range(num):
        _check(padded, i, layouts)
    return padded


def reorder(value: Any, inverse: torch.Tensor, layouts: Sequence[Layout] | None) -> Any:
    """`value` (the batch's output) with the rows of its outputs that have rows taken in
    `inverse`'s order: those `layouts` say have them, else every tensor with as many rows."""
    rows = len(inverse)
    if layouts is not None:
        leaves, spec = pytree.tree_flatten(value)
        if len(leaves) == len(layouts):
            return pytree.tree_unflatten(
                [v.index_select(0, inverse.to(v.device)) if layout.rows
                 and isinstance(v, torch.Tensor) and v.dim() > 0 else v
                 for v, layout in zip(leaves, layouts, strict=True)], spec)

    def back(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
            return v.index_select(0, inverse.to(v.device))
        return v
    return pytree.tree_map(back, value)


def _following(outputs: Sequence[tuple[Any, ...]], i: int, groups: Sequence[Sequence[int]],
               lengths: Sequence[int]) -> tuple[int, ...]:
    """The dims (after the rows) of output `i` that have each micro-batch's own trimmed
    length in every micro-batch: the positions, where the lengths are not all alike."""
    if len(set(lengths)) < 2:
        return ()  # all alike: `tokens.plan` left them untrimmed, nothing to pad
    values = [out[i] for out in outputs if i < len(out) and isinstance(out[i], torch.Tensor)
              and out[i].dim() >= 2]
    if len(values) != len(outputs):
        return ()
    ndim = {v.dim() for v in values}
    if len(ndim) != 1:
        return ()
    found = []
    for d in range(1, ndim.pop()):
        if all(v.shape[0] == len(g) and v.shape[d] == n
               for v, g, n in zip(values, groups, lengths, strict=True)):
            found.append(d)
    return tuple(found)


def _padded(v: Any, dims: tuple[int, ...], extra: int) -> Any:
    if not dims or extra <= 0 or not isinstance(v, torch.Tensor):
        return v
    # F.pad counts dims from the last, a (before, after) pair for each.
    widths = [0] * (2 * v.dim())
    for d in dims:
        widths[2 * (v.dim() - 1 - d) + 1] = extra
    return F.pad(v, widths)


def _check(padded: Sequence[tuple[Any, ...]], i: int, layouts: Sequence[Layout] | None
           ) -> None:
    """Output `i` of every micro-batch fits the others' (all but the rows), or a refusal
    naming it: its sizes follow neither the batch nor the positions."""
    values = [out[i] for out in padded if i < len(out)]
    shapes = [tuple(v.shape[1:]) for v in values if isinstance(v, torch.Tensor) and v.dim()]
    if len(set(shapes)) <= 1:
        return
    name = f"output[{i}]" if layouts is None else f"output leaf {i}"
    raise PipeConfigError(
        f"tokens= trims each micro-batch to its longest row, and {name} has sizes "
        f"{sorted(set(shapes))} (after the rows) over the micro-batches: they follow neither "
        f"the batch's rows nor the positions, so the batch's output cannot be put together: "
        f"run pipe(x) without tokens=")
