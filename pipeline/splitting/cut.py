"""Cut an exported graph into stage graphs at module boundaries, finding what crosses each cut.

A split point names a module of the model; its stage begins at the first op the module runs.
Every value made before a cut and used after it (an activation, the attention mask, rotary
tables, a skip connection's features, the model's own inputs) becomes an output of each stage
it passes and an input of the next, so stages chain as an nn.Sequential does. Weights are not
values: each stage reads the ones it uses by their names in the model.
"""

from __future__ import annotations

import difflib
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind

from pipeline.splitting.outline import OUTLINED
from pipeline.splitting.trace import ExportError

__all__ = ["Piece", "SplitPointError", "cut", "module_order", "size_carrier", "user_inputs"]


class SplitPointError(ExportError):
    """A split point that is not a module of the model, or not one the model runs in order."""


@dataclass
class Piece:
    """One stage's graph: inputs are the values crossing into it (placeholders), the output is
    the tuple crossing out; `tensors` are the model's parameters and buffers it reads (by
    name), `constants` and `submodules` what else its get_attr nodes name."""

    graph: fx.Graph
    tensors: list[str] = field(default_factory=list)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    submodules: dict[str, nn.Module] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def size_carrier(n: int, like: torch.Tensor | None) -> torch.Tensor:
    """A size (a symbolic batch dimension) crossing stages, as an empty (n, 0) tensor: the
    transport moves tensors, and an empty one costs its header only."""
    device = like.device if like is not None else None
    return torch.empty((n, 0), dtype=torch.int64, device=device)


def _carried_size(carrier: torch.Tensor) -> int:
    return carrier.shape[0]


def user_inputs(ep: torch.export.ExportedProgram) -> list[tuple[fx.Node, Any, bool]]:
    """The model's inputs in flattening order: (placeholder, fixed value, is a tensor). A
    non-tensor input (`use_cache=False`) is fixed at export; its value is kept here."""
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs
             if s.kind is InputKind.USER_INPUT}
    found = []
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in specs:
            arg = specs[node.name].arg
            tensor = isinstance(node.meta.get("val"), torch.Tensor)
            found.append((node, getattr(arg, "value", None), tensor))
    return found


def _stack(node: fx.Node) -> list[str]:
    return [_module_name(v[0]) for v in (node.meta.get("nn_module_stack") or {}).values()]


# A block reached through a slice of its ModuleList (`self.layers[:n]`, as Qwen3 under PEFT's
# prefix tuning runs them) is recorded as `layers.slice(None, 4, None).0`.
_SLICED = re.compile(r"\.slice\((None|-?\d+), (None|-?\d+), (None|-?\d+)\)\.(\d+)")


def _module_name(path: str) -> str:
    """The module's name in the model for a path export recorded (its slices resolved)."""
    def index(match: re.Match[str]) -> str:
        start, step = match[1], match[3]
        first = 0 if start == "None" else int(start)
        if first < 0:  # counted from the end: the list's length is not known here
            return match[0]
        return f".{first + int(match[4]) * (1 if step == 'None' else int(step))}"
    return _SLICED.sub(index, path)


def module_order(ep: torch.export.ExportedProgram) -> list[str]:
    """The model's modules in the order their first op runs (the valid split points)."""
    seen: dict[str, None] = {}
    for node in ep.graph.nodes:
        if node.op == "call_function":
            for path in _stack(node):
                if path:
                    seen.setdefault(path, None)
    return list(seen)


def _boundaries(ep: torch.export.ExportedProgram, model: nn.Module,
                split_points: Sequence[str], compute: list[fx.Node]) -> list[int]:
    """Index into `compute` of the first op of each split point, checked."""
    names = {n for n, _ in model.named_modules() if n}
    first: dict[str, int] = {}
    for i, node in enumerate(compute):
        for path in _stack(node):
            first.setdefault(path, i)
    found: list[int] = []
    for point in split_points:
        if not isinstance(point, str):
            raise SplitPointError(f"split points are module names (str), got {point!r}")
        if point not in names:
            near = difflib.get_close_matches(point, sorted(names), n=3, cutoff=0.5)
            raise SplitPointError(
                f"split point {point!r} is not a module of {type(model).__name__}"
                + (f"; nearest: {', '.join(map(repr, near))}" if near else "")
                + f" (valid points are names from model.named_modules() that run, e.g. "
                  f"{', '.join(map(repr, _examples(module_order(ep))))})")
        if point not in first:
            raise SplitPointError(
                f"split point {point!r} never runs in the model's forward (for these example "
                f"inputs), so no stage can begin there: choose a module that runs")
        index = first[point]
        if index == 0:
            raise SplitPointError(
                f"split point {point!r} is where the model begins: the stage before it would "
                f"be empty; split at a later module")
        if found and index <= found[-1]:
            before = split_points[len(found) - 1]
            raise SplitPointError(
                f"split points must follow the order the model runs them: {point!r} runs "
                f"{'before' if index < found[-1] else 'together with'} {before!r}; list them "
                f"in order, each a module that begins after the previous one")
        found.append(index)
    return found


def _examples(order: list[str]) -> list[str]:
    deep = [p for p in order if p.rsplit(".", 1)[-1].isdigit()]  # repeated blocks first
    return (deep or order)[:3]


def cut(ep: torch.export.ExportedProgram, model: nn.Module,
        split_points: Sequence[str]) -> list[Piece]:
    """The stage graphs of `ep` cut before each of `split_points` (module names, in order)."""
    sig = ep.graph_signature
    bad = [o for o in sig.output_specs if o.kind is not OutputKind.USER_OUTPUT]
    if bad:
        raise ExportError(f"the exported graph mutates {[o.target for o in bad]} as outputs "
                          f"(kind {bad[0].kind.name}), which Pipe cannot split yet")
    kinds = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
    graph = ep.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    compute = [n for n in graph.nodes if n.op in ("call_function", "get_attr")]
    output = next(n for n in graph.nodes if n.op == "output")
    cuts = _boundaries(ep, model, split_points, compute)
    num = len(cuts) + 1

    stage: dict[fx.Node, int] = {}
    k = 0
    for i, node in enumerate(compute):
        while k < len(cuts) and i >= cuts[k]:
            k += 1
        stage[node] = k
    for node in compute:  # a multi-output op and its getitems stay together
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            stage[node] = stage.get(node.args[0], stage[node])
        elif node.op == "get_attr":  # a submodule reference goes where it is used
            stage[node] = min(stage[u] for u in node.users) if node.users else stage[node]

    inputs = user_inputs(ep)
    fixed = {node: value for node, value, tensor in inputs if not tensor}
    weights: dict[fx.Node, str] = {}
    constants: dict[fx.Node, torch.Tensor] = {}
    for node in placeholders:
        spec = kinds[node.name]
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            weights[node] = str(spec.target)
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            constants[node] = ep.constants[str(spec.target)]
        elif spec.kind is InputKind.USER_INPUT:
            stage[node] = -1
        else:
            raise ExportError(f"the exported graph takes a {spec.kind.name} input "
                              f"({node.name}), which Pipe cannot split")

    last_use: dict[fx.Node, int] = {}
    for node, s in stage.items():
        uses = [stage[u] if u.op != "output" else num - 1 for u in node.users]
        last_use[node] = max(uses, default=s)
    tensor_inputs = [node for node, _, tensor in inputs if tensor]
    crossing = [[n for n in [*tensor_inputs, *compute] if stage[n] <= k < last_use[n]]
                for k in range(num - 1)]
    ins = [tensor_inputs, *crossing]
    return [_build(k, ins[k], crossing[k] if k < num - 1 else None, output, compute, stage,
                   weights, constants, fixed)
            for k in range(num)]


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.SymInt | int) and not isinstance(
        node.meta.get("val"), bool)


def _build(k: int, inputs: list[fx.Node], outputs: list[fx.Node] | None, output: fx.Node,
           compute: list[fx.Node], stage: dict[fx.Node, int], weights: dict[fx.Node, str],
           constants: dict[fx.Node, torch.Tensor], fixed: dict[fx.Node, Any]) -> Piece:
    g = fx.Graph()
    piece = Piece(g)
    env: dict[fx.Node, Any] = {}
    first_tensor: fx.Node | None = None
    for node in inputs:
        ph = g.placeholder(node.name)
        ph.meta["val"] = node.meta.get("val")  # its shape: which capture a call fits
        piece.inputs.append(node.name)
        if _is_size(node):
            env[node] = g.call_function(_carried_size, (ph,))
        else:
            env[node] = ph
            first_tensor = first_tensor or ph
    env.update(fixed)  # non-tensor inputs were fixed at export (use_cache=False)

    def lookup(node: fx.Node) -> Any:
        if node in env:
            return env[node]
        if node in weights:
            name = weights[node]
            if name not in piece.tensors:
                piece.tensors.append(name)
            env[node] = g.get_attr(name)
            return env[node]
        if node in constants:
            name = f"_const_{len(piece.constants)}"
            piece.constants[name] = constants[node]
            env[node] = g.get_attr(name)
            return env[node]
        raise AssertionError(f"stage {k}: {node.name} is neither computed here nor crossing in")

    for node in compute:
        if stage[node] != k:
            continue
        if node.op == "get_attr":
            sub = _owner(node)
            if isinstance(sub, fx.GraphModule):  # a higher-order op's body (no_grad, autocast)
                _follow_the_inputs(sub.graph)
                sub.recompile()
            piece.submodules[str(node.target)] = sub
        env[node] = g.node_copy(node, lookup)
        # A module kept whole (pipeline/splitting/outline.py) reads its own tensors.
        piece.tensors.extend(n for n in node.meta.get(OUTLINED, ()) if n not in piece.tensors)
    if outputs is None:
        values = fx.node.map_arg(output.args[0], lookup)
    else:
        values = tuple(g.call_function(size_carrier, (lookup(n), first_tensor))
                       if _is_size(n) else lookup(n) for n in outputs)
        piece.outputs = [n.name for n in outputs]
    g.output(tuple(values) if isinstance(values, list | tuple) else (values,))
    _follow_the_inputs(g)
    _drop_whole_slices(g)
    return piece


def _drop_whole_slices(g: fx.Graph) -> None:
    """`x[:, :]` exports as `slice(x, 1, 0, 2**63 - 1)`: a view of all of x, whose backward
    still allocates zeros and copies into them. Each use reads x itself instead (a Llama layer
    has two; benchmarks/tracing.py)."""
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
            continue
        defaults: list[Any] = [None, 0, None, None, 1]  # (self, dim, start, end, step)
        args: list[Any] = [*node.args, *defaults[len(node.args):]]
        source, start, end, step = args[0], args[2], args[3], args[4]
        if start in (None, 0) and (end is None or (isinstance(end, int) and end >= 2**62)) \
                and step == 1 \
                and not node.kwargs:
            node.replace_all_uses_with(source)
            g.erase_node(node)


def _device_of(value: torch.Tensor) -> torch.device:
    return value.device


def _follow_the_inputs(g: fx.Graph) -> None:
    """Export writes the device the model was traced on into the graph (`arange(device=meta)`,
    `to(device=cpu)`, metadata asserts): a stage runs where its inputs arrive (the runtime
    moves them to its device), so each device constant becomes the first input's device, and
    the asserts, checks of the traced device only, go."""
    first = next((n for n in g.nodes if n.op == "placeholder"), None)
    device: fx.Node | None = None
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            g.erase_node(node)
            continue
        if first is None or not any(isinstance(v, torch.device) for v in
                                    [*node.args, *node.kwargs.values()]):
            continue
        if device is None:
            with g.inserting_after(first):
                device = g.call_function(_device_of, (first,))

        def swap(v: Any, device: fx.Node = device) -> Any:
            return device if isinstance(v, torch.device) else v
        node.args = tuple(swap(v) for v in node.args)
        node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}


def _owner(node: fx.Node) -> nn.Module:
    root = node.graph.owning_module
    assert root is not None
    value = root.get_submodule(str(node.target))
    return value
