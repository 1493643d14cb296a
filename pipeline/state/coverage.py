"""Chunks that describe a whole tensor: each element of every saved tensor in exactly one chunk.

DCP reads each tensor chunk by chunk into the tensor being loaded: an element no chunk covers
keeps the model's own value, and nobody is told. So a load checks the metadata first. The
chunks' boundaries cut every dimension into intervals, and the tensor into the grid of their
products (cells); each chunk is a box of cells, and every cell must lie in exactly one box.
A save's chunks form a grid already (one cell per chunk), so the check costs what the
metadata holds; crafted chunks that cut the tensor into more than `MAX_CELLS` cells are
refused rather than counted.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_CELLS", "uncovered"]

MAX_CELLS = 1 << 22


def uncovered(size: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int]]]
              ) -> str | None:
    """Why `chunks` ((offsets, sizes) each, already within `size`) do not cover a tensor of
    `size` exactly once, naming the first part left out or covered twice; None if they do."""
    if math.prod(size) == 0:
        return None  # no element to cover
    cuts = [sorted({0, n, *(o[d] for o, _ in chunks), *(o[d] + s[d] for o, s in chunks)})
            for d, n in enumerate(size)]
    shape = tuple(len(c) - 1 for c in cuts)
    if math.prod(shape) > MAX_CELLS:
        return (f"its {len(chunks)} chunks cut it into {math.prod(shape)} pieces, more than "
                f"the {MAX_CELLS} a save's chunks ever do")
    count = np.zeros(shape, dtype=np.int64)
    for offsets, sizes in chunks:
        box = tuple(slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s))
                    for c, o, s in zip(cuts, offsets, sizes, strict=True))
        count[box] += 1
        if count[box].max(initial=0) > 1:
            return _part(cuts, np.argwhere(count > 1)[0], "is in more than one chunk")
    if (count == 0).any():
        return _part(cuts, np.argwhere(count == 0)[0], "is in no chunk")
    return None


def _part(cuts: list[list[int]], cell: np.ndarray, what: str) -> str:
    """The elements of one cell as slices, `[0:4, 8:16]`."""
    if not cuts:
        return f"its one element (a tensor of no dimensions) {what}"
    ranges = ", ".join(f"{c[i]}:{c[i + 1]}" for c, i in zip(cuts, cell.tolist(), strict=True))
    return f"its part [{ranges}] {what}"
