"""Which inputs and outputs of a split model run along the positions, from the graph's sizes.

Export keeps the length of a batch symbolic (pipeline/splitting/shapes.py), so the graph says
which tensors share it: the ids, the mask, an encoder-only model's labels and `position_ids`
have the same symbol in dim 1; a seq2seq model's decoder labels have another (the decoder's
length), a classifier's logits a fixed size (its labels), attention weights the length in
dims 2 and 3. A causal LM's labels, shifted inside the model, get a symbol of their own: the
loss that compares them with the logits says they are the positions too (its targets are as
many as its predictions). Token micro-batches (pipeline/runtime/tokens.py) trim exactly the
inputs that share the mask's length, and `pipe(x)` pads back exactly the outputs' dims that
are that length: never by a size that happens to equal it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeline.errors import PipeConfigError
from pipeline.splitting.cut import user_inputs

__all__ = ["Layout", "Positions", "paths", "refuse"]


@dataclass(frozen=True)
class Layout:
    """How `pipe(x)` puts one output leaf back together under token micro-batches: the dims
    padded back to the batch's length, whether dim 0 holds the batch's rows (put back in the
    caller's order), and, for an output that cannot be put back, why (`refused`)."""

    pad: tuple[int, ...] = ()
    rows: bool = False
    refused: str | None = None


@dataclass(frozen=True)
class Positions:
    """A graph's sizes: per tensor input its dim 1 (a sympy expression, an int, or None
    without one), per output leaf its shape (None: not a tensor), the symbols of the
    batch's rows, and the sizes its losses need equal (`equal`: predictions and targets)."""

    inputs: tuple[Any, ...]
    outputs: tuple[tuple[Any, ...] | None, ...]
    batch: frozenset[Any]
    equal: tuple[tuple[Any, Any], ...] = ()

    @classmethod
    def of(cls, ep: torch.export.ExportedProgram, num_leaves: int) -> Positions:
        """The sizes of `ep`'s tensor inputs and of its first `num_leaves` outputs (the
        model's own: the weights of 0-dim outputs come after them)."""
        tensors = [node.meta["val"] for node, _, tensor in user_inputs(ep) if tensor]
        inputs = tuple(_size(t.shape[1]) if t.dim() >= 2 else None for t in tensors)
        batch: set[Any] = set()
        for t in tensors:
            if t.dim() > 0:
                batch |= _symbols(_size(t.shape[0]))
        output = next(n for n in ep.graph.nodes if n.op == "output")
        leaves = output.args[0] if isinstance(output.args[0], list | tuple) else [
            output.args[0]]
        shapes: list[tuple[Any, ...] | None] = []
        for leaf in list(leaves)[:num_leaves]:
            val = leaf.meta.get("val") if hasattr(leaf, "meta") else None
            shapes.append(tuple(_size(d) for d in val.shape)
                          if isinstance(val, torch.Tensor) else None)
        return cls(inputs, tuple(shapes), frozenset(batch), _losses(ep.graph))

    def length(self, reference: int) -> Any:
        """The symbol of the positions: input `reference`'s dim 1 (the mask's), or None
        where the graph fixed it (the model's code needs that length)."""
        size = self.inputs[reference] if reference < len(self.inputs) else None
        return size if _symbols(size) == {size} else None

    def trimmed(self, reference: int) -> frozenset[int] | None:
        """The inputs whose dim 1 is input `reference`'s length (those a token micro-batch
        trims); None where the graph does not say (a fixed length)."""
        length = self.length(reference)
        if length is None:
            return None
        return frozenset(i for i, size in enumerate(self.inputs)
                         if size == length or self._tied(size, length))

    def _tied(self, size: Any, length: Any) -> bool:
        """Whether a loss needs `size` to be `length` (with the batch's rows alike): a causal
        LM's labels, shifted in the model, against its logits."""
        import sympy  # slow to import: only where a graph is captured

        if _symbols(size) != {size}:
            return False
        rows = sympy.Symbol("rows", positive=True, integer=True)
        alike = {b: rows for b in self.batch}
        for a, b in self.equal:
            gap = sympy.expand((a - b).subs(alike))
            if gap != 0 and sympy.expand(gap.subs(size, length)) == 0:
                return True
        return False

    def layouts(self, reference: int, names: Sequence[str]) -> tuple[Layout, ...] | None:
        """How each output leaf (named by `names`) is put back together when the inputs
        sharing input `reference`'s length are trimmed; None where the graph does not say."""
        length = self.length(reference)
        if length is None:
            return None
        out = []
        for shape, name in zip(self.outputs, names, strict=True):
            if not shape:
                out.append(Layout())
                continue
            rows = bool(_symbols(shape[0]) & self.batch)
            pad = tuple(d for d in range(1, len(shape)) if shape[d] == length)
            mixed = [d for d, size in enumerate(shape)
                     if d not in pad and length in _symbols(size)]
            refused = None
            if mixed:
                d = mixed[0]
                refused = (f"output{name} has size {shape[d]} in dim {d}, computed from the "
                           f"length of the positions ({length}) but not that length, so its "
                           f"trimmed micro-batches cannot be padded back to the batch's")
            out.append(Layout(pad, rows, refused))
        return tuple(out)


def paths(spec: pytree.TreeSpec, num: int) -> list[str]:
    """How each of the `num` leaves of an output of structure `spec` is reached (`.logits`,
    `[0]`), for an error to name it."""
    try:
        tree = pytree.tree_unflatten(list(range(num)), spec)
        found = dict((leaf, pytree.keystr(path)) for path, leaf in
                     pytree.tree_flatten_with_path(tree)[0])
        return [found.get(i, f"[{i}]") for i in range(num)]
    except Exception:  # a type registered without keys: the leaf's index says enough
        return [f"[{i}]" for i in range(num)]


def refuse(layouts: Sequence[Layout]) -> None:
    """Refuse outputs that trimmed micro-batches cannot give back as the model does."""
    for layout in layouts:
        if layout.refused is not None:
            raise PipeConfigError(f"tokens= trims each micro-batch to its longest row, and "
                                  f"{layout.refused}: run pipe(x) without tokens=")


# Losses comparing predictions (rows, classes, ...) with class targets (rows, ...).
_TOKEN_LOSSES = {torch.ops.aten.cross_entropy_loss.default, torch.ops.aten.nll_loss.default,
                 torch.ops.aten.nll_loss_nd.default, torch.ops.aten.nll_loss_forward.default}


def _losses(graph: torch.fx.Graph) -> tuple[tuple[Any, Any], ...]:
    """The sizes each token loss of `graph` needs equal: its predictions' count (all but
    the classes) and its targets'."""
    import sympy  # slow to import: only where a graph is captured

    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _TOKEN_LOSSES:
            continue
        vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None
                for a in node.args[:2]]
        x, target = vals
        if not (isinstance(x, torch.Tensor) and isinstance(target, torch.Tensor)
                and x.dim() >= 2 and not target.is_floating_point()):
            continue
        count = sympy.Integer(1)
        for d, size in enumerate(x.shape):
            if d != 1:
                count = count * _size(size)
        targets = sympy.Integer(1)
        for size in target.shape:
            targets = targets * _size(size)
        found.append((count, targets))
    return tuple(found)


def _size(d: Any) -> Any:
    return d.node.expr if isinstance(d, torch.SymInt) else int(d)


def _symbols(size: Any) -> set[Any]:
    return set(getattr(size, "free_symbols", ()) or ())
