"""Every batch its own length: a captured graph's sizes, and whether a batch's tensors fit them.

Export keeps every dimension of every tensor input symbolic where the model lets it (Dim.AUTO),
so one graph serves any length; what it could not keep symbolic it records: a dimension fixed
to the example's size (the model's code needs that size), a range (a guard on a length: BERT's
position table bounds its sequence by `max_position_embeddings`), two dimensions that must be
equal (the ids and the mask). A position table bounds the length too, though no guard says
so: it is found in the graph (pipeline/splitting/tables.py). `Limits` holds all of these for
one graph and says, before any work, whether a batch fits, or why not (the input, the
dimension, the value, the graph's): the caller captures again or refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from pipeline.splitting.tables import Table, tables

__all__ = ["Limits", "Misfit", "signature"]


@dataclass(frozen=True)
class Misfit:
    """Why a batch does not fit a graph: input `name`'s dimension `dim` is `value`, where the
    graph takes `wanted` (a size, a range, or another input's size in words)."""

    name: str
    dim: int
    value: int
    wanted: str
    table: bool = False  # a position table's bound: no capture can lift it
    shared: bool = False  # the graph needs it equal to another input's size

    def __str__(self) -> str:
        return (f"input {self.name!r} has size {self.value} in dim {self.dim}, where the "
                f"captured graph takes {self.wanted}")


def signature(tensors: Sequence[Any]) -> tuple[Any, ...]:
    """A batch's shape signature: each tensor's shape without its rows (dim 0)."""
    return tuple(tuple(t.shape[1:]) if isinstance(t, torch.Tensor) and t.dim() else None
                 for t in tensors)


@dataclass
class Limits:
    """One graph's sizes for its tensor inputs (`dims[i][d]`: an int, fixed, or a sympy
    expression of its symbols), the symbols' ranges, and the position tables it reads."""

    names: list[str]
    dims: list[list[Any]]
    ranges: dict[Any, tuple[int, int | None]]
    rows: frozenset[int]  # inputs whose dim 0 is the batch's (split into micro-batches)
    tables: list[Table] = field(default_factory=list)

    @classmethod
    def of(cls, placeholders: Sequence[fx.Node], ranges: dict[Any, Any],
           rows: frozenset[int], graph: fx.Graph | None = None,
           weights: dict[str, str] | None = None) -> Limits:
        """The limits of a graph taking `placeholders` (with export's `meta["val"]`) under
        `ranges` (export's range constraints); `graph` is searched for position tables
        (`weights`: its placeholders' names in the model)."""
        dims = []
        for node in placeholders:
            val = node.meta.get("val")
            # A size crossing a cut travels as an empty (size, 0) tensor (cut.size_carrier).
            shape = val.shape if isinstance(val, torch.Tensor) else (
                (val, 0) if isinstance(val, int | torch.SymInt) else ())
            dims.append([d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in shape])
        bounds = {}
        for symbol, vr in ranges.items():
            upper = _finite(vr.upper)
            # Export assumes a symbolic size is at least 2 (0 and 1 are specialised); the
            # graph runs 1 alike (a micro-batch of one row does), so only a real guard counts.
            lower = _finite(vr.lower) or 1
            lower = lower if lower > 2 else 1
            bounds[symbol] = (lower, upper)
        limits = cls([n.name for n in placeholders], dims, bounds, rows)
        if graph is not None:
            limits.tables = tables(graph, list(placeholders), weights or {})
        return limits

    def misfit(self, tensors: Sequence[Any]) -> Misfit | None:
        """The first way `tensors` (the model's tensor inputs, whole batch) do not fit, or
        None. Rows (dim 0 of inputs split into micro-batches) are not checked here: every
        micro-batch has its own."""
        bound: dict[Any, tuple[int, str, int]] = {}
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or i >= len(self.dims):
                continue
            want = self.dims[i]
            if t.dim() != len(want):
                return Misfit(self.names[i], -1, t.dim(), f"{len(want)} dimensions")
            for d, size in enumerate(t.shape):
                if d == 0 and i in self.rows:
                    continue
                got = self._fits(want[d], int(size), (self.names[i], d), bound)
                if got is not None:
                    return Misfit(self.names[i], d, int(size), got,
                                  shared=got.startswith("the size of"))
        for table in self.tables:
            largest = None if table.values else table.largest(tensors)
            if largest is not None and largest >= table.rows:
                return self._past(table, tensors, largest)
        return None

    def reads(self, tensors: Sequence[Any]) -> list[int | None]:
        """The largest index each table read at positions counted from the inputs' values
        (a mask's, the ids') reads for this batch: only a rank holding the batch knows it."""
        return [table.largest(tensors) for table in self.tables if table.values]

    def overread(self, tensors: Sequence[Any], reads: Sequence[int | None]) -> Misfit | None:
        """The first table read past, by `reads` (what `reads` gave for the batch, on the
        ranks holding it), as a misfit of `tensors` (the batch, or tensors of its shapes);
        or None."""
        counted = [table for table in self.tables if table.values]
        for table, largest in zip(counted, reads, strict=True):
            if largest is not None and largest >= table.rows:
                return self._past(table, tensors, largest)
        return None

    def _past(self, table: Table, tensors: Sequence[Any], largest: int) -> Misfit:
        """A batch reading `table` at `largest`, past its rows: named by the input its
        positions are computed from, and that input's length."""
        i = table.inputs[0]
        d = _longest_dim(tensors[i])
        return Misfit(self.names[i], d, int(tensors[i].shape[d]),
                      f"positions below {table.rows} (the rows of {table.weight}; this "
                      f"batch reads position {largest})", table=True)

    def _fits(self, want: Any, size: int, where: tuple[str, int],
              bound: dict[Any, tuple[int, str, int]]) -> str | None:
        if isinstance(want, int):
            return None if want == size else f"{want} only (the model's code fixed it)"
        if not want.is_Symbol:  # a size derived from others (2 * s0): checked once bound
            value = want.subs({s: v[0] for s, v in bound.items()})
            if value.is_number and int(value) != size:
                return f"{want} = {int(value)}"
            return None
        if want in bound:
            other, name, d = bound[want][0], bound[want][1], bound[want][2]
            if other != size:
                return (f"the size of dim {d} of {name!r} ({other}): the model needs them "
                        f"equal")
            return None
        lower, upper = self.ranges.get(want, (1, None))
        if size < lower or (upper is not None and size > upper):
            return f"sizes {lower} to {upper if upper is not None else 'any'}"
        bound[want] = (size, *where)
        return None


def _finite(bound: Any) -> int | None:
    """A range's bound as an int, None where infinite (sympy's oo, torch's int_oo)."""
    import sympy  # slow to import: only where a graph is captured

    return int(bound) if isinstance(bound, sympy.Integer) else None


def _longest_dim(t: torch.Tensor) -> int:
    """The dimension a position table reads along: the last of the longest (the sequence)."""
    return max(range(1, t.dim()), key=lambda d: (t.shape[d], d)) if t.dim() > 1 else 0

