"""Modules kept whole in a split model: their ops in the exported graph become one call of the
module itself.

Tensor parallelism shards a module's weights and hooks its calls (torch's `ParallelStyle`);
the ops of an exported graph call neither, and bake in shapes (a view to 4 heads) that a
shard no longer has. A module kept whole runs as the model defined it, on whatever its
weights have become, so the ops around it (embedding, rotary tables, masks, the residual
stream) stay traced and split as before.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import ConstantArgument, SymIntArgument, TensorArgument

from pipeline.splitting.trace import ExportError

__all__ = ["OUTLINED", "held_whole", "outline", "whole_modules"]

OUTLINED = "pipeline_outlined"  # a call node's meta: the model's names of the module's tensors


def whole_modules(model: nn.Module, selected: Iterable[str]) -> list[str]:
    """The modules to keep whole so that each of `selected` (module names, e.g. a tp plan's
    linears) runs as its module: its parent (an attention or MLP block, whose own code
    reshapes by the width it is given) unless that is the model itself or holds a stack of
    blocks (a ModuleList or Sequential, where stages are cut), else the module itself."""
    chosen: list[str] = []
    for name in selected:
        parent = name.rpartition(".")[0]
        whole = parent if parent and not _holds_blocks(model.get_submodule(parent)) else name
        if whole not in chosen:
            chosen.append(whole)
    # An ancestor kept whole covers its descendants.
    return [w for w in chosen if not any(w.startswith(o + ".") for o in chosen if o != w)]


def _holds_blocks(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList | nn.Sequential) for m in module.modules())


def held_whole(name: str, whole: Sequence[str]) -> bool:
    """Whether module `name` runs inside a module kept whole (or is one)."""
    return any(name == w or name.startswith(w + ".") for w in whole)


def _stack(node: fx.Node) -> list[str]:
    return [v[0] for v in (node.meta.get("nn_module_stack") or {}).values()]


def outline(ep: torch.export.ExportedProgram, model: nn.Module, names: Sequence[str]) -> None:
    """Replace, in `ep`'s graph, the ops of each module in `names` (exported with
    `preserve_module_call_signature=names`) by one call of the module."""
    calls = {e.fqn: e.signature for e in ep.module_call_graph}
    for name in names:
        signature = calls.get(name)
        if signature is None:
            raise ExportError(f"module {name!r} was not exported with its call signature, so "
                              f"it cannot be kept whole")
        _outline(ep.graph, model, name, signature)


def _outline(graph: fx.Graph, model: nn.Module, name: str, signature: Any) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    region = [n for n in graph.nodes if n.op in ("call_function", "get_attr")
              and name in _stack(n)]
    if not region:
        return  # the module never ran for these inputs: nothing to replace
    by_name = {n.name: n for n in graph.nodes}
    kinds: list[tuple[bool, Any]] = []  # (a graph value?, the node or the constant)
    for arg in signature.inputs:
        if isinstance(arg, TensorArgument | SymIntArgument):
            kinds.append((True, by_name[arg.name]))
        elif isinstance(arg, ConstantArgument):
            kinds.append((False, arg.value))
        else:
            raise ExportError(f"module {name!r} takes a {type(arg).__name__} input, which a "
                              f"module kept whole cannot be given")
    first = region[0]
    late = [n.name for is_value, n in kinds if is_value and order[n] > order[first]]
    if late:
        raise ExportError(f"module {name!r} cannot be kept whole: its input(s) {late} are "
                          f"computed while it runs")
    outputs = [(i, by_name[a.name]) for i, a in enumerate(signature.outputs)
               if isinstance(a, TensorArgument)]
    inside = set(region)
    leaving = {o for _, o in outputs}
    escaped = [n.name for n in region for u in n.users if u not in inside and n not in leaving]
    if escaped:
        raise ExportError(f"module {name!r} cannot be kept whole: {escaped} leave it other "
                          f"than as its outputs")
    module = model.get_submodule(name)
    call = _caller(module, name, [(v, None if v else c) for v, c in kinds],
                   signature.in_spec, [i for i, _ in outputs])
    stack = first.meta.get("nn_module_stack") or {}
    keep = list(stack)[:[v[0] for v in stack.values()].index(name) + 1]
    meta_stack = {k: stack[k] for k in keep}
    with graph.inserting_before(first):
        node = graph.call_function(call, tuple(n for is_value, n in kinds if is_value))
        node.meta["nn_module_stack"] = meta_stack
        node.meta["val"] = tuple(o.meta.get("val") for _, o in outputs)
        node.meta[OUTLINED] = [f"{name}.{k}" for k, _ in
                               [*module.named_parameters(remove_duplicate=False),
                                *module.named_buffers(remove_duplicate=False)]]
        for j, (_, out) in enumerate(outputs):
            got = graph.call_function(operator.getitem, (node, j))
            got.meta.update({"nn_module_stack": meta_stack, "val": out.meta.get("val")})
            out.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region):
        graph.erase_node(n)


def _caller(module: nn.Module, name: str, kinds: list[tuple[bool, Any]], in_spec: Any,
            picks: list[int]) -> Callable[..., tuple[Any, ...]]:
    """The function a stage's code calls: the module, with the constants the export fixed
    and the values the graph gives, its tensor outputs as a tuple."""

    def call(*values: Any) -> tuple[Any, ...]:
        given = iter(values)
        leaves = [next(given) if is_value else constant for is_value, constant in kinds]
        args, kwargs = pytree.tree_unflatten(leaves, in_spec)
        flat = pytree.tree_leaves(module(*args, **kwargs))
        return tuple(flat[i] for i in picks)

    call.__name__ = "whole_" + name.replace(".", "_")
    call.__qualname__ = call.__name__
    return call
