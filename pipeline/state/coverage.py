"""Chunks that describe a whole tensor: each element of every saved tensor in exactly one chunk.

DCP reads each tensor chunk by chunk into the tensor being loaded: an element no chunk covers
keeps the model's own value, and nobody is told. So a load checks the metadata first. The
chunks' boundaries cut every dimension into intervals, and the tensor into the grid of their
products (pieces); each chunk is a box of pieces, and every piece must lie in exactly one box.

A save's chunks form that grid themselves (each chunk one piece: a tensor split along some
dimensions over ranks), and are checked in time near-linear in their number: sorted
boundaries, then one set of pieces. Chunks that are no grid (a crafted file, or some other
writer's tiling) are counted piece by piece, which costs what the pieces number: a file's
tensors may be cut so into `MAX_PIECES` pieces in all, and a file past that is refused.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_PIECES", "Coverage"]

MAX_PIECES = 1 << 22

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)


class Coverage:
    """Checks the tensors of one metadata file, whose chunks that are no grid share one budget
    of `pieces`."""

    def __init__(self, pieces: int = MAX_PIECES) -> None:
        self.left = pieces

    def uncovered(self, size: Sequence[int], chunks: Sequence[Box]) -> str | None:
        """Why `chunks` ((offsets, sizes) each, already within `size`) do not cover a tensor
        of `size` exactly once, naming a part left out or covered twice (an overlap before a
        gap); None if they do."""
        if math.prod(size) == 0:
            return None  # no element to cover
        boxes = [(o, s) for o, s in chunks if math.prod(s) != 0]  # an empty chunk covers none
        cuts = [sorted({0, n, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)})
                for d, n in enumerate(size)]
        places = [{c: i for i, c in enumerate(cut)} for cut in cuts]
        low = [tuple(p[x] for p, x in zip(places, o, strict=True)) for o, _ in boxes]
        high = [tuple(p[x + y] for p, x, y in zip(places, o, s, strict=True)) for o, s in boxes]
        shape = tuple(len(c) - 1 for c in cuts)
        if all(h == tuple(i + 1 for i in lo) for lo, h in zip(low, high, strict=True)):
            return _grid(cuts, shape, low)
        pieces = math.prod(shape)
        if pieces > self.left:
            return (f"its {len(chunks)} chunks cut it into {pieces} pieces, and the file's "
                    f"tensors into more than the {MAX_PIECES} a file's chunks may (a save's cut "
                    f"each tensor into one piece per chunk)")
        self.left -= pieces
        return _counted(cuts, shape, np.array(low, dtype=np.int64).reshape(-1, len(shape)),
                        np.array(high, dtype=np.int64).reshape(-1, len(shape)))


def _grid(cuts: list[list[int]], shape: tuple[int, ...], cells: list[tuple[int, ...]]
          ) -> str | None:
    """Chunks of one piece each (at `cells`): each piece must be some chunk's, once."""
    seen: set[tuple[int, ...]] = set()
    for cell in cells:
        if cell in seen:
            return _part(cuts, cell, "is in more than one chunk")
        seen.add(cell)
    if len(seen) == math.prod(shape):
        return None
    # fewer chunks than pieces: one of the first len(seen) + 1 pieces is missing
    missing = next(c for c in itertools.product(*map(range, shape)) if c not in seen)
    return _part(cuts, missing, "is in no chunk")


def _counted(cuts: list[list[int]], shape: tuple[int, ...], low: np.ndarray, high: np.ndarray
             ) -> str | None:
    """Chunks as boxes of pieces [`low`, `high`): how many chunks hold each piece, counted
    with numpy in time that follows the pieces (boxes past the first overlap are not
    expanded: they would only add to it)."""
    pieces = math.prod(shape)
    extent = np.prod(high - low, axis=1)
    total = np.cumsum(extent)
    if total.size and total[-1] > pieces:  # some piece is held twice by the first `last` boxes
        last = int(np.searchsorted(total, pieces, side="right")) + 1
        low, high = low[:last], high[:last]
    # Each box's pieces as flat indices, one dimension at a time: every index so far is
    # repeated once per position of the box in the next dimension.
    flat = np.zeros(len(low), dtype=np.int64)
    owner = np.arange(len(low))
    stride = pieces
    for d, n in enumerate(shape):
        stride //= n
        repeats = (high[:, d] - low[:, d])[owner]
        starts = np.cumsum(repeats) - repeats
        flat, owner = np.repeat(flat, repeats), np.repeat(owner, repeats)
        position = np.arange(len(flat)) - np.repeat(starts, repeats)
        flat += (low[owner, d] + position) * stride
    count = np.bincount(flat, minlength=pieces)
    for where, what in ((count > 1, "is in more than one chunk"), (count == 0, "is in no chunk")):
        found = np.flatnonzero(where)
        if found.size:
            cell = [int(i) for i in np.unravel_index(int(found[0]), shape)]
            return _part(cuts, cell, what)
    return None


def _part(cuts: list[list[int]], cell: Sequence[int], what: str) -> str:
    """The elements of one piece as slices, `[0:4, 8:16]`."""
    if not cuts:
        return f"its one element (a tensor of no dimensions) {what}"
    ranges = ", ".join(f"{c[i]}:{c[i + 1]}" for c, i in zip(cuts, cell, strict=True))
    return f"its part [{ranges}] {what}"
