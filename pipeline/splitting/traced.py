"""A model split from its exported graph: stages that run that graph on the model's own tensors.

`SplitModel` is an nn.Sequential of `TracedStage`s, so everything built for Sequential stages
(schedules, recomputation, ties, dp x pp, checkpoints, the planner) takes it as it is. Each
stage holds, under their names in the model, the model's own Parameter and buffer objects it
reads: whole submodules where one stage uses all of a module (so `reset_parameters`, a
user's `param_init` and BatchNorm hooks see real modules), `Mirror` containers where several
stages share a module. Its state_dict keys are the model's keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from pipeline.errors import PipeConfigError
from pipeline.splitting.checks import check_input_rows
from pipeline.splitting.cut import Piece
from pipeline.splitting.placing import Mirror
from pipeline.splitting.scalars import Scalars
from pipeline.splitting.shapes import Limits
from pipeline.splitting.trace import check_example

__all__ = ["MODES", "Mirror", "SplitModel", "TracedStage", "layer_key", "merge_into"]

MODES = ("train", "eval")


class TracedStage(nn.Module):
    """One stage: takes the tuple of values crossing into it and returns the tuple crossing
    out, running the train or the eval graph as the model's mode says at each call
    (model.eval() turns dropout off and BatchNorm to its running statistics, as in the
    model)."""

    def __init__(self, index: int, pieces: dict[str, Piece], model: nn.Module | None = None
                 ) -> None:
        super().__init__()
        self.index = index
        self.inputs = {m: tuple(p.inputs) for m, p in pieces.items()}
        self.outputs = {m: tuple(p.outputs) for m, p in pieces.items()}
        self.__dict__["_pieces"] = pieces  # compiled once the tensors are in place
        # One entry per capture (pipeline/splitting/lengths.py): each mode's forward, its
        # values in and out, and the shapes it takes (None: the first, taking any it runs).
        self.__dict__["_variants"] = []
        # The model (not a child: its tensors are placed here by name): its training flag is
        # the mode, so model.eval() reaches the stages as it reaches the model's children.
        self.__dict__["_model"] = model
        # The captures made in the model's dtypes now (lengths.py sets it before each batch;
        # None: every capture).
        self.__dict__["_usable"] = None

    @property
    def mode(self) -> str:
        """"train" or "eval": the model's mode (`model.train()`, `pipe.train()`, this
        stage's or its SplitModel's `.train()` all set it)."""
        model = self.__dict__["_model"]
        return "train" if (model.training if model is not None else self.training) else "eval"

    def train(self, mode: bool = True) -> TracedStage:
        """As `nn.Module.train`, and the model's mode with it (what the stage runs)."""
        super().train(mode)
        model = self.__dict__["_model"]
        if model is not None and model.training != mode:
            model.train(mode)
        return self

    def compile(self, limits: dict[str, Limits] | None = None) -> None:
        """Generate each mode's forward, naming this stage's attributes (`limits`: the
        shapes each mode's graph takes)."""
        self.add_variant(self.__dict__.pop("_pieces"), limits)

    def use(self, captures: frozenset[int] | None) -> None:
        """Run only these captures (those made in the model's dtypes now; None: any)."""
        self.__dict__["_usable"] = captures

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> TracedStage:
        """As `nn.Module._apply`, but a capture's own constants keep the dtype their graph
        was captured with (`pipe.to(torch.bfloat16)` and back would round them): they move
        device only. The model's tensors convert as the model's."""
        kept = {name: t for name, t in self._buffers.items()
                if _internal(name) and t is not None and t.is_floating_point()}
        for name in kept:
            self._buffers[name] = None
        try:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        finally:
            for name, t in kept.items():
                self._buffers[name] = t.to(fn(t).device)
        return self

    def add_variant(self, pieces: dict[str, Piece], limits: dict[str, Limits] | None) -> None:
        """Take the stage graphs of another capture (`limits`: the shapes each mode's takes):
        a call runs the latest capture whose shapes its values fit."""
        k = len(self.__dict__["_variants"])
        tag = f"v{k}_" if k else ""
        device = next((t.device for t in [*self.parameters(), *self.buffers()]), None)
        code = {}
        for mode, piece in pieces.items():
            graph = piece.graph
            for node in graph.nodes:
                if node.op == "get_attr" and (node.target in piece.submodules
                                              or node.target in piece.constants):
                    # each mode and capture its own
                    name = f"_{mode}_{tag}{str(node.target).lstrip('_')}"
                    if node.target in piece.submodules:
                        self.add_module(name, piece.submodules[node.target])
                    else:
                        constant = piece.constants[node.target]
                        if k and device is not None:  # the first is moved with the stage
                            constant = constant.to(device)
                        self.register_buffer(name, constant, persistent=False)
                    node.target = name
            code[mode] = _compile(graph)
        io = {m: (tuple(p.inputs), tuple(p.outputs)) for m, p in pieces.items()}
        self.__dict__["_variants"].append((code, io, limits))

    @property
    def captures(self) -> int:
        """How many captures of the model this stage can run (one per shape family)."""
        return len(self.__dict__["_variants"])

    def forward(self, values: Any) -> tuple[Any, ...]:
        values = values if isinstance(values, tuple) else (values,)
        mode = self.mode
        variants = self.__dict__["_variants"]
        code, io, _ = variants[0] if len(variants) == 1 else self._variant(values, mode)
        expected = io[mode][0]
        if len(values) != len(expected):
            raise PipeConfigError(
                f"stage {self.index} takes {len(expected)} values in {mode} mode "
                f"({', '.join(expected)}), got {len(values)}: a SplitModel's stages run "
                f"in the mode it had when it was split, or after .train()/.eval()")
        result: tuple[Any, ...] = code[mode](self, *values)
        return result

    def _variant(self, values: tuple[Any, ...], mode: str) -> Any:
        """The latest capture whose inputs these values fit (every rank captured alike)."""
        variants = self.__dict__["_variants"]
        usable = self.__dict__["_usable"]
        usable = range(len(variants)) if usable is None else sorted(usable)
        for k in reversed(usable):
            _, io, limits = variants[k]
            if len(io[mode][0]) == len(values) and (
                    limits is None or limits[mode].misfit(values) is None):
                return variants[k]
        return variants[min(usable, default=0)]  # which says what it could not take

    def extra_repr(self) -> str:
        return (f"index={self.index}, takes={list(self.inputs['train'])}, "
                f"gives={list(self.outputs['train'])}")


class SplitModel(nn.Sequential):
    """The stages of a model split at module boundaries (see `pipeline.split`). Calling it as
    the model is called (`split(input_ids=...)`) runs the stages one after another; `Pipe`
    takes it as one stage per layer."""

    def __init__(self, stages: Sequence[TracedStage], in_spec: pytree.TreeSpec,
                 out_specs: dict[str, pytree.TreeSpec], constants: dict[int, Any],
                 split_points: Sequence[str], scalars: dict[str, Scalars] | None = None
                 ) -> None:
        super().__init__(*stages)
        self.in_spec = in_spec
        self.out_specs = out_specs
        self.constants = constants  # leaf index -> the fixed non-tensor value (use_cache)
        self.split_points = list(split_points)
        # Per mode, how 0-dim outputs combine over micro-batches (pipeline/splitting/scalars.py)
        self.scalars = scalars or {m: Scalars(out_specs[m].num_leaves) for m in MODES}
        self.input_names: list[str] = []  # of the tensor inputs, in flattening order
        self.broadcast: frozenset[int] = frozenset()  # those captured with one row
        self.whole: tuple[str, ...] = ()  # modules run whole (pipeline/splitting/outline.py)
        # Per mode, which inputs and outputs run along the positions (positions.py)
        self.positions: dict[str, Any] = {}
        # The captures' limits; more captures for shapes they do not take (lengths.py)
        self.lengths: Any = None
        # Its state_dict speaks the model's keys: `split.load_state_dict(model.state_dict())`.
        self._register_state_dict_hook(_model_keys)  # type: ignore[no-untyped-call]
        self._register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
            _stage_keys, with_module=True)

    def flatten(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        """The tensors of `inputs` (given as `example_inputs` was: a tensor, a tuple of
        arguments, a dict of keyword arguments, or a pair (args, kwargs)) in the order the
        first stage takes them; non-tensor arguments must equal those the model was split
        with."""
        args, kwargs = check_example(inputs)
        names = list(_children(self.in_spec)[1].context)
        if set(kwargs) != set(names):
            raise PipeConfigError(
                f"the model was split for keyword inputs {sorted(names)}; got "
                f"{sorted(kwargs)}: pass the same keywords (as a dict, or a pair (args, "
                f"kwargs))")
        leaves, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in names}))
        if spec != self.in_spec:
            raise PipeConfigError(
                f"the inputs' structure {spec} differs from the one the model was split with "
                f"{self.in_spec}: pass inputs shaped as example_inputs")
        tensors = []
        for i, leaf in enumerate(leaves):
            if i in self.constants:
                if leaf is not self.constants[i] and leaf != self.constants[i]:
                    raise PipeConfigError(
                        f"input leaf {i} is {leaf!r}, but the model was split with "
                        f"{self.constants[i]!r}: non-tensor arguments are fixed when the "
                        f"graph is captured; split again to change them")
            else:
                tensors.append(leaf)
        return tuple(tensors)

    @property
    def captures(self) -> int:
        """How many times the model was captured: 1, plus one per family of shapes the
        first capture did not take (pipeline/splitting/lengths.py)."""
        return self.lengths.captures if self.lengths is not None else 1

    @property
    def mode(self) -> str:
        """"train" or "eval": what the stages run now (the model's mode)."""
        return self[0].mode if len(self) and isinstance(self[0], TracedStage) else (
            "train" if self.training else "eval")

    def prepare(self, inputs: Any, chunks: int | None = None) -> tuple[Any, ...] | None:
        """Before any work: the checks a step or `pipe(x)` (with `chunks` micro-batches)
        needs, and `inputs` flattened (None, a rank without the first stage, stays None)."""
        if chunks is not None:
            self.scalars[self.mode].check(chunks, self.out_specs[self.mode])
        tensors = None if inputs is None else self.flatten(inputs)
        if tensors is not None:
            check_input_rows(tensors, self.input_names, self.broadcast)
        if self.lengths is not None:  # every rank, under processes: they capture together
            self.lengths.admit(tensors)
        return tensors

    def unflatten(self, outputs: Any, mode: str | None = None) -> Any:
        """The last stage's outputs as the model returns them (a ModelOutput, a dict...);
        the weights of 0-dim outputs after the model's own outputs are left out."""
        mode = mode or self.mode
        leaves = list(outputs) if isinstance(outputs, tuple) else [outputs]
        return pytree.tree_unflatten(leaves[:self.scalars[mode].num_leaves],
                                     self.out_specs[mode])

    def merge(self, outputs: Sequence[tuple[Any, ...]]) -> Any:
        """The model's output for the whole batch from each micro-batch's: rows
        concatenated, 0-dim outputs combined as the batch's (weighted means, sums)."""
        mode = self.mode
        return pytree.tree_unflatten(self.scalars[mode].merge(outputs), self.out_specs[mode])

    def with_outputs(self, loss_fn: Callable[[Any, Any], Any], mode: str | None = None
                     ) -> Callable[[Any, Any], Any]:
        """`loss_fn` called with the model's output as the model returns it."""
        mode = mode or self.mode

        def loss(outputs: Any, target: Any) -> Any:
            return loss_fn(self.unflatten(outputs, mode), target)
        return loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values: Any = self.prepare((args, kwargs))
        for stage in self:
            values = stage(values)
        return self.unflatten(values)


def _model_keys(module: SplitModel, state: dict[str, Any], prefix: str, _: Any) -> None:
    """State-dict hook: `{prefix}{stage}.{key}` becomes `{prefix}{key}` (the first stage
    holding a key reports it)."""
    for key in [k for k in state if k.startswith(prefix)]:
        stage, _, rest = key[len(prefix):].partition(".")
        value = state.pop(key)
        if stage.isdigit():
            state.setdefault(prefix + rest, value)


def _stage_keys(module: SplitModel, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load pre-hook: each model key goes to every stage that holds it."""
    for index, stage in enumerate(module):
        for key in nn.Module.state_dict(stage):
            if prefix + key in state:
                state[f"{prefix}{index}.{key}"] = state[prefix + key]
    for key in {k for stage in module for k in nn.Module.state_dict(stage)}:
        state.pop(prefix + key, None)


_OP = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


def _compile(graph: fx.Graph) -> Callable[..., tuple[Any, ...]]:
    """The graph's Python code, `forward(self, *inputs)`, each aten op called as the
    dispatcher's own callable: FX writes `torch.ops.aten.linear.default(...)`, four attribute
    lookups and a Python frame (OpOverload.__call__) per op, which a stage of many small ops
    pays for every micro-batch (benchmarks/tracing.py)."""
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)

    def direct(match: re.Match[str]) -> str:
        name = "_op_" + "_".join(match.groups())
        op = getattr(getattr(getattr(torch.ops, match[1]), match[2]), match[3])
        namespace[name] = op._op if isinstance(op, torch._ops.OpOverload) else op
        return name + "("
    exec(compile(_OP.sub(direct, code.src), "<stage>", "exec"), namespace)
    forward: Callable[..., tuple[Any, ...]] = namespace["forward"]
    return forward


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    children = getattr(spec, "children", None)
    if callable(children):
        return list(children())
    return list(spec.children_specs)


def layer_key(model: nn.Module, name: str, key: str) -> str:
    """The model's key of `key` in layer `name` of `model`: a SplitModel's stages already hold
    their tensors by the split model's keys, an nn.Sequential's layers under their index."""
    if isinstance(model, SplitModel):
        return key
    return f"{name}.{key}" if key else name


def _internal(name: str) -> bool:
    return name.startswith(("_train_", "_eval_"))


def merge_into(target: nn.Module, source: nn.Module) -> None:
    """Register `source`'s tensors and modules on `target` under the same names, so a Pipe
    holding several stages shows one tree with the model's keys: the model's modules as they
    are, Mirrors merged into fresh Mirrors (a stage's own Mirrors are left as they are)."""
    for name, t in [*source._parameters.items(), *source._buffers.items()]:
        if t is None or _internal(name) or name in target._parameters or name in target._buffers:
            continue
        if isinstance(t, nn.Parameter):
            target.register_parameter(name, t)
        else:
            target.register_buffer(name, t,
                                   persistent=name not in source._non_persistent_buffers_set)
    for name, child in source._modules.items():
        if child is None or _internal(name):
            continue
        have = target._modules.get(name)
        if not isinstance(child, Mirror):
            if have is None:
                target.add_module(name, child)
            continue
        if have is None:
            have = Mirror()
            target.add_module(name, have)
        if isinstance(have, Mirror):
            merge_into(have, child)
