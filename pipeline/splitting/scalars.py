"""0-dim outputs of a model split from its graph, combined over micro-batches as the batch's.

`pipe(x)` runs the model on micro-batches and concatenates what has a batch dimension; a 0-dim
output (a loss, a regulariser) has none. The exported graph says what each one is, and so how
the micro-batches' values make the batch's, exactly:

| the output is                                         | the batch's value                       |
|-------------------------------------------------------|-----------------------------------------|
| a mean of a tensor with rows of the batch             | the micro-batches' means weighted by    |
|                                                       | each one's element count                |
| a token mean (`cross_entropy`/`nll_loss`, mean)       | weighted by each one's counted targets  |
|                                                       | (not `ignore_index`; class weights)     |
| an element-wise loss's mean (`mse_loss`, `l1_loss`,   | weighted by each one's element count    |
| `binary_cross_entropy`...) of a tensor with rows      | (a sum: the micro-batches' sum)         |
| a sum of a tensor with rows of the batch              | the micro-batches' sum                  |
| a value that does not depend on the batch             | any micro-batch's (all equal)           |
| a scaling, cast or view of one of these; a sum of two | the same, if the weights agree          |
| of one kind; a mean plus a constant                   |                                         |

The weights (element counts, counted targets) are computed by the graph itself, as extra
outputs after the model's own. For training, a mean's weight is also built as a small graph of
its own (`Counter`): the graph's ops from the model's inputs to what the mean divides by (a
causal LM's shift of its labels included), so a step can count every micro-batch before any
forward (pipeline/runtime/weighting.py). Anything else (a product of two batch means: a mixture of
experts' load-balancing loss; a sum of a token mean and a row mean) has no exact combination:
`pipe(x)` refuses it with more than one micro-batch, naming the output.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from pipeline.errors import PipeConfigError
from pipeline.splitting.positions import paths as output_paths

__all__ = ["Counter", "Scalars", "plan"]

aten = torch.ops.aten
_MEAN, _SUM, _SAME = "mean", "sum", "same"

# Ops through which a kind passes unchanged: casts, copies and views of a 0-dim value.
_THROUGH = {aten.clone.default, aten.alias.default, aten.detach.default, aten.neg.default,
            aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
            aten.view.default, aten.reshape.default, aten.squeeze.default,
            aten.squeeze.dim, aten.contiguous.default}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.div.Tensor,
          aten.div.Scalar, aten.div_.Tensor}
_ADD = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor}
# Losses averaging over every element of their input: op -> the index of its reduction.
_ELEMENTWISE = {aten.mse_loss.default: 2, aten.l1_loss.default: 2,
                aten.smooth_l1_loss.default: 2, aten.huber_loss.default: 2,
                aten.binary_cross_entropy.default: 3,
                aten.binary_cross_entropy_with_logits.default: 4}
_TOKEN = {aten.cross_entropy_loss.default: 4, aten.nll_loss.default: 4,
          aten.nll_loss_nd.default: 4, aten.nll_loss2d.default: 4}  # op: ignore_index arg


@dataclass(frozen=True)
class _Kind:
    """How one value combines: `kind`, and for a mean what weighs it: `("rows",)` (any
    tensor with rows of the batch has as many elements per row in every micro-batch, so all
    such means weigh alike: by `source`'s element count) or `("tokens", target, weight,
    ignore_index)`."""

    kind: str
    weight: tuple[Any, ...] | None = None
    source: fx.Node | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Counter:
    """What a 0-dim mean output divides by, from one micro-batch's model inputs alone:
    `graph` (the model's own ops on the inputs named `names`) gives its counted targets, or,
    for a mean over rows (None), the micro-batch's rows, which weigh every such mean alike."""

    names: tuple[str, ...]
    graph: fx.GraphModule | None

    def __call__(self, input_names: Sequence[str], inputs: Sequence[Any]) -> float:
        """The count for one micro-batch, its inputs flattened as the first stage takes them
        (`input_names` name them)."""
        if self.graph is None:
            rows = [v.shape[0] for v in inputs if isinstance(v, torch.Tensor) and v.dim() > 0]
            return float(max(rows, default=1))
        by_name = dict(zip(input_names, inputs, strict=True))
        with torch.no_grad():
            return float(self.graph(*(by_name[n] for n in self.names)))


@dataclass
class Scalars:
    """One mode's plan: the model's output leaves, which of them are 0-dim and how each
    combines (`combine[i] = (kind, index of its weight among the extra outputs)`), what a
    mean's weight is counted from (`counters[i]`), and why the others cannot be
    (`refused[i]`)."""

    num_leaves: int
    combine: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    counters: dict[int, Counter] = field(default_factory=dict)
    dims: dict[int, int] = field(default_factory=dict)  # leaf -> dims, of tensor leaves

    def returned(self, loss_fn: Callable[[Any, Any], Any], spec: pytree.TreeSpec
                 ) -> int | None:
        """The 0-dim output `loss_fn` returns as it is (`lambda out, y: out.loss`), found by
        calling it once on stand-ins of the outputs (meta tensors, no data, target None),
        whether it combines or not; None if it returns anything else or fails on them (it
        computes a loss of its own)."""
        if not self.combine and not self.refused:
            return None
        leaves = [torch.empty((1,) * self.dims.get(i, 1), device="meta")
                  for i in range(self.num_leaves)]
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = loss_fn(pytree.tree_unflatten(leaves, spec), None)
        except Exception:  # a loss of its own: it reads the target or computes on the logits
            return None
        found = [i for i in [*self.combine, *self.refused] if got is leaves[i]]
        return found[0] if found else None

    def check(self, chunks: int, spec: pytree.TreeSpec) -> None:
        """Refuse, before any work, a 0-dim output that micro-batches cannot reproduce."""
        if chunks <= 1 or not self.refused:
            return
        paths = output_paths(spec, self.num_leaves)
        i, why = next(iter(self.refused.items()))
        names = ", ".join(f"output{paths[k]}" for k in self.refused)
        raise PipeConfigError(
            f"pipe(x) with chunks={chunks} cannot give {names} as the model does: "
            f"output{paths[i]} is a 0-dim value {why}, which no weighting of the "
            f"micro-batches' values reproduces (a mixture of experts' load-balancing loss is "
            f"one). Run it in one "
            f"micro-batch, pipe(x, chunks=1), or compute it from outputs that have rows "
            f"(the router logits)")

    def merge(self, outputs: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The model's output leaves from each micro-batch's last-stage outputs: rows
        concatenated, 0-dim values combined by their kind."""
        leaves: list[Any] = []
        for i in range(self.num_leaves):
            values = [o[i] for o in outputs]
            first = values[0]
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                leaves.append(torch.cat(values))
            elif i in self.combine and len(values) > 1:
                kind, w = self.combine[i]
                leaves.append(_combine(kind, values, [o[self.num_leaves + w] for o in outputs]
                                       if w is not None else []))
            else:
                leaves.append(first)
        return leaves


def _combine(kind: str, values: list[torch.Tensor], weights: list[torch.Tensor]
             ) -> torch.Tensor:
    dtype = values[0].dtype
    if kind == _SUM:
        return torch.stack([v.to(torch.float64) for v in values]).sum().to(dtype)
    if kind == _SAME:
        return values[0]
    w = torch.stack([torch.as_tensor(w, device=values[0].device).to(torch.float64)
                     for w in weights])
    v = torch.stack([v.to(torch.float64) for v in values])
    # A micro-batch counting nothing has mean 0/0 (nan) and weight 0: it adds nothing, as
    # its tokens add nothing to the batch's mean (all of them nothing: 0/0, as the model).
    total = torch.where(w > 0, v * w, torch.zeros_like(v)).sum() / w.sum()
    return total.to(dtype)


def _tokens(target: torch.Tensor, weight: torch.Tensor | None, ignore: int) -> torch.Tensor:
    """What a token-mean loss divides by: its counted targets (their class weights)."""
    counted = target != ignore
    if weight is None:
        return counted.sum()
    return (weight[target.clamp(min=0) * counted] * counted).sum()


def _numel(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x.numel(), dtype=torch.float64, device=x.device)


def plan(graph: fx.Graph, batch_inputs: Sequence[fx.Node]) -> Scalars:
    """Classify the graph's 0-dim outputs and add their weights as extra outputs (after the
    model's own). `batch_inputs`: the model's inputs split by rows (dim 0 symbolic)."""
    output = next(n for n in graph.nodes if n.op == "output")
    leaves = list(output.args[0]) if isinstance(output.args[0], list | tuple) else [
        output.args[0]]
    symbols = set()
    for node in batch_inputs:
        size = node.meta["val"].shape[0]
        if isinstance(size, torch.SymInt):
            symbols |= size.node.expr.free_symbols
    analysis = _Analysis(set(batch_inputs), symbols)
    result = Scalars(len(leaves))
    result.dims = {i: leaf.meta["val"].dim() for i, leaf in enumerate(leaves)
                   if isinstance(leaf, fx.Node)
                   and isinstance(leaf.meta.get("val"), torch.Tensor)}
    extra: list[fx.Node] = []
    weights: dict[tuple[Any, ...], int] = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, fx.Node) or not _is_scalar(leaf):
            continue
        found = analysis.kind(leaf)
        if isinstance(found, str):
            result.refused[i] = found
            continue
        index = None
        if found.weight is not None:
            if found.weight not in weights:
                # Beside what it counts: the count (0-dim) crosses to the last stage, not
                # the tensor counted.
                rows = found.weight[0] == "rows"
                source = found.source if rows else found.weight[1]
                assert isinstance(source, fx.Node)
                where = (graph.inserting_after(source) if source.op != "placeholder"
                         else graph.inserting_before(output))
                with where:
                    node = (graph.call_function(_numel, (source,)) if rows
                            else graph.call_function(_tokens, found.weight[1:]))
                weights[found.weight] = len(extra)
                extra.append(node)
            index = weights[found.weight]
            counter = _counter(graph, found.weight, analysis.batch_inputs)
            if counter is not None:
                result.counters[i] = counter
        result.combine[i] = (found.kind, index)
    if extra:
        output.args = ((*leaves, *extra),)
    return result


def _counter(graph: fx.Graph, weight: tuple[Any, ...], inputs: set[fx.Node]
             ) -> Counter | None:
    """A mean's weight from the model's inputs alone: the graph's ops that make its targets
    (and class weights), copied into a graph of their own; None where they read anything but
    the model's inputs split by rows, `inputs` (a class weight held as a buffer), or call a
    module."""
    if weight[0] == "rows":
        return Counter((), None)
    target, class_weight, ignore = weight[1:]
    roots = [n for n in (target, class_weight) if isinstance(n, fx.Node)]
    needed: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    names = []
    copy = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:  # in graph order: every node after its inputs
        if node not in needed:
            continue
        if node.op == "placeholder":
            if node not in inputs:
                return None
            names.append(node.name)
            env[node] = copy.placeholder(node.name)
        elif node.op == "call_function":
            env[node] = copy.node_copy(node, lambda n: env[n])
        else:
            return None
    count = copy.call_function(_tokens, (env[target], env.get(class_weight, class_weight),
                                         ignore))
    copy.output(count)
    return Counter(tuple(names), fx.GraphModule(torch.nn.Module(), copy))


def _name(kind: _Kind) -> str:
    return kind.kind + ("" if kind.weight is None else f" over {kind.weight[0]}")


def _is_scalar(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


class _Analysis:
    """What a 0-dim node is, from the ops that made it; a str says why it is none of the
    kinds that combine."""

    def __init__(self, batch_inputs: set[fx.Node], symbols: set[Any]) -> None:
        self.batch_inputs = batch_inputs
        self.symbols = symbols
        self._depends: dict[fx.Node, bool] = {}

    def depends(self, value: Any) -> bool:
        """Whether `value` is computed from the batch's rows."""
        if not isinstance(value, fx.Node):
            return False
        if value not in self._depends:
            stack, seen, found = [value], {value}, False
            while stack and not found:
                node = stack.pop()
                if node in self.batch_inputs:
                    found = True
                for n in node.all_input_nodes:
                    if n in self._depends:
                        found = found or self._depends[n]
                    elif n not in seen:
                        seen.add(n)
                        stack.append(n)
            self._depends[value] = found
        return self._depends[value]

    def rows(self, node: Any) -> bool:
        """Whether `node` has rows of the batch: its element count grows with the batch."""
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return False
        numel = val.numel()
        return isinstance(numel, torch.SymInt) and bool(
            numel.node.expr.free_symbols & self.symbols)

    def kind(self, node: fx.Node) -> _Kind | str:
        if not self.depends(node):
            return _Kind(_SAME)
        op = node.target
        args = node.args
        if op in _THROUGH:
            return self.kind(args[0]) if isinstance(args[0], fx.Node) else "of a constant"
        if op in (aten.mean.default, aten.mean.dim, aten.sum.default, aten.sum.dim_IntList):
            x = args[0]
            if not isinstance(x, fx.Node) or not self.rows(x):
                return (f"made by {op} of a tensor without rows of the batch (a reduction "
                        f"over the batch came first)")
            mean = op in (aten.mean.default, aten.mean.dim)
            return _Kind(_MEAN, ("rows",), x) if mean else _Kind(_SUM)
        if op in _ELEMENTWISE:  # (input, target, ..., reduction): 1 a mean, 2 a sum
            at = _ELEMENTWISE[op]
            reduction = args[at] if len(args) > at else node.kwargs.get("reduction", 1)
            x = args[0]
            if not isinstance(x, fx.Node) or not self.rows(x) or reduction not in (1, 2):
                return f"made by {op} of a tensor without rows of the batch"
            return _Kind(_MEAN, ("rows",), x) if reduction == 1 else _Kind(_SUM)
        if op in _TOKEN or op is aten.nll_loss_forward.default or (
                op is operator.getitem and isinstance(args[0], fx.Node)
                and args[0].target is aten.nll_loss_forward.default and args[1] == 0):
            return self._token(args[0] if op is operator.getitem else node)  # type: ignore[arg-type]
        if op in _SCALE:
            a, b = args[0], args[1]
            if not self.depends(b):
                return self.kind(a) if isinstance(a, fx.Node) else "of a constant"
            if op in (aten.mul.Tensor, aten.mul_.Tensor) and not self.depends(a):
                return self.kind(b)  # type: ignore[arg-type]
            return f"made by {op} of two values of the batch"
        if op in _ADD:
            kinds = [self.kind(a) if isinstance(a, fx.Node) else _Kind(_SAME) for a in args[:2]]
            for k in kinds:
                if isinstance(k, str):
                    return k
            one, two = kinds
            assert isinstance(one, _Kind) and isinstance(two, _Kind)
            if one == two:
                return one
            if {one.kind, two.kind} == {_MEAN, _SAME}:
                return one if one.kind == _MEAN else two
            return (f"made by {op} of two values combined in different ways "
                    f"({_name(one)} and {_name(two)})")
        return f"made by {op}"

    def _token(self, node: fx.Node) -> _Kind | str:
        """A cross-entropy or NLL loss: (input, target, weight, reduction, ignore_index)."""
        defaults: list[Any] = [None, None, None, 1, -100]
        args = [*node.args, *defaults[len(node.args):]]
        for i, name in enumerate(("weight", "reduction", "ignore_index"), start=2):
            if name in node.kwargs:
                args[i] = node.kwargs[name]
        target, weight, reduction, ignore = args[1], args[2], args[3], args[4]
        val = target.meta.get("val") if isinstance(target, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point:
            return f"made by {node.target} with probabilities as targets"
        if not self.rows(target):
            return f"made by {node.target} of targets without rows of the batch"
        if reduction == 2:
            return _Kind(_SUM)
        if reduction != 1:
            return f"made by {node.target} with reduction {reduction}"
        return _Kind(_MEAN, ("tokens", target, weight, ignore))
