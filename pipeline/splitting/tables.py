"""Position tables: the weights a graph indexes at positions computed from its inputs.

A model reads a table of fixed size at positions it computes from its inputs: GPT-2's `wpe`
and BART's learned positions at `arange(length)`, GPT-J's rotary `embed_positions` buffer
indexed by `arange(length)`, OPT's learned positions counted from the attention mask
(`cumsum(mask) * mask - 1`, plus 2), RoBERTa's counted from the ids that are not padding. A
batch reading past the table fails inside the forward (IndexError); no capture lifts that.
Each such read is found in the graph (`aten.embedding`, `index`, `index_select` or `gather`
on a parameter or buffer, along a dimension whose size the model fixes, at indices computed
from the inputs alone through an `arange` or a `cumsum`), with the small graph that computes
its indices, so the largest index a batch reads is known before any work: from the inputs'
shapes where the indices come from sizes alone (every rank knows them), else from the values
of the inputs they come from (a mask, the ids: a cumulative sum over the batch, on the CPU).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

__all__ = ["Table", "tables"]

aten = torch.ops.aten

# Ops a table is reached through from a weight (its views, casts, broadcasts).
_VIEWS = {aten.expand.default, aten.view.default, aten.reshape.default,
          aten.unsqueeze.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
          aten.clone.default, aten.detach.default, aten.alias.default, aten.type_as.default,
          aten.contiguous.default}
# What makes indices positions: counted along the length (arange) or over the tokens (cumsum).
_POSITIONS = {aten.arange, aten.cumsum}


@dataclass
class Table:
    """A table of `rows` rows (along the indexed dimension of the model's `weight`) read at
    indices that `graph` computes from the model's tensor inputs `inputs` (by their sizes
    alone, or by their `values` too)."""

    weight: str
    rows: int
    graph: fx.GraphModule
    inputs: list[int]
    values: bool

    def largest(self, tensors: Sequence[Any]) -> int | None:
        """The largest index this batch reads (`tensors`: the model's tensor inputs; where
        the indices come from sizes alone, tensors of the batch's shapes suffice), or None
        where the indices' graph does not run here (the forward will say)."""
        batch = [tensors[i] if i < len(tensors) else None for i in self.inputs]
        held = [t for t in batch if isinstance(t, torch.Tensor)]
        if len(held) < len(batch):
            return None
        try:
            # Sizes alone: an expanded scalar of the shape, no memory; values: on the CPU.
            given = [t.detach().cpu() if self.values
                     else torch.zeros((), dtype=t.dtype).expand(t.shape) for t in held]
            with torch.no_grad():
                indices = self.graph(*given)
            if not isinstance(indices, torch.Tensor) or indices.numel() == 0:
                return None
            return int(indices.max())
        except Exception:  # a graph that needs another device, a meta input
            return None


def tables(graph: fx.Graph, inputs: list[fx.Node], names: dict[str, str]) -> list[Table]:
    """The tables `graph` reads at positions computed from its tensor inputs `inputs` (its
    other placeholders are weights, `names` their names in the model), embeddings first."""
    weights = {n: names.get(n.name, n.name) for n in graph.nodes if n.op == "placeholder"
               and n not in inputs}
    found = []
    for node in graph.nodes:
        for source, dim, indices in _reads(node):
            weight = _weight(source, weights)
            val = source.meta.get("val")
            if weight is None or not isinstance(val, torch.Tensor):
                continue
            rows = val.shape[dim % val.dim()] if val.dim() else None
            computed = _computed(indices, inputs) if isinstance(rows, int) else None
            if rows is None or computed is None:
                continue
            nodes, used, values = computed
            sub = _subgraph(graph, nodes, indices, [inputs[i] for i in used])
            found.append((node.target is not aten.embedding.default,
                          Table(weights[weight], int(rows), sub, used, values)))
    return [table for _, table in sorted(found, key=lambda f: f[0])]


def _reads(node: fx.Node) -> Iterator[tuple[fx.Node, int, fx.Node]]:
    """Each (tensor, dimension, indices) that `node` indexes."""
    if node.op != "call_function":
        return
    args = node.args
    if node.target is aten.embedding.default:
        yield from _pairs([(args[0], 0, args[1])])
    elif node.target in (aten.index_select.default, aten.gather.default):
        yield from _pairs([(args[0], args[1], args[2])])
    elif node.target is aten.index.Tensor:
        index = list(args[1]) if isinstance(args[1], list | tuple) else []
        if any(isinstance(i, fx.Node) and _dtype(i) == torch.bool for i in index):
            return  # a boolean mask spans dimensions: not a read at positions
        yield from _pairs([(args[0], d, i) for d, i in enumerate(index)])


def _pairs(reads: list[tuple[Any, Any, Any]]) -> Iterator[tuple[fx.Node, int, fx.Node]]:
    for source, dim, indices in reads:
        if isinstance(source, fx.Node) and isinstance(dim, int) and isinstance(indices,
                                                                               fx.Node):
            yield source, dim, indices


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _weight(node: fx.Node, weights: dict[fx.Node, str]) -> fx.Node | None:
    """The parameter or buffer `node` is (through views and casts), or None."""
    while node not in weights:
        if node.op != "call_function" or node.target not in _VIEWS or not node.args:
            return None
        first = node.args[0]
        if not isinstance(first, fx.Node):
            return None
        node = first
    return node


def _computed(indices: fx.Node, inputs: list[fx.Node]
              ) -> tuple[set[fx.Node], list[int], bool] | None:
    """The nodes `indices` is computed from, which inputs among them, and whether their
    values are read (not their sizes alone), if they are positions computed from the inputs
    alone (no weight, nothing random or in place, an arange or a cumsum on the way); else
    None."""
    seen: set[fx.Node] = set()
    stack = [indices]
    positions = False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n not in inputs:  # a weight: not computed from the inputs alone
                return None
            continue
        if n.op != "call_function" or not _pure(n.target):
            return None
        positions = positions or getattr(n.target, "overloadpacket", None) in _POSITIONS
        stack.extend(n.all_input_nodes)
    if not positions:
        return None
    used = [i for i, p in enumerate(inputs) if p in seen]
    values = any(u in seen and u.target is not aten.sym_size.int
                 for i in used for u in inputs[i].users)
    return (seen, used, values) if used else None


def _pure(target: Any) -> bool:
    """An op that reads its arguments only: an aten op neither mutating nor random, or
    arithmetic on sizes."""
    if isinstance(target, torch._ops.OpOverload):
        return (not target._schema.is_mutable
                and torch.Tag.nondeterministic_seeded not in target.tags)
    return getattr(target, "__module__", None) in (operator.__name__, "_operator")


def _subgraph(graph: fx.Graph, nodes: set[fx.Node], output: fx.Node,
              inputs: list[fx.Node]) -> fx.GraphModule:
    """`nodes` of `graph` as a graph taking `inputs` and returning `output`, on the CPU."""
    sub = fx.Graph()
    env = {p: sub.placeholder(p.name) for p in inputs}
    for n in graph.nodes:
        if n in nodes and n not in env:
            env[n] = sub.node_copy(n, env.__getitem__)
            if "device" in env[n].kwargs:
                env[n].kwargs = {**env[n].kwargs, "device": torch.device("cpu")}
    sub.output(env[output])
    return fx.GraphModule({}, sub)
