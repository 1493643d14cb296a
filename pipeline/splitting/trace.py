"""Capture a model's forward as one graph with torch.export, or say clearly why it cannot be.

Non-strict export runs the model's own Python with fake tensors and records the aten ops it
calls (the training IR: not functionalised, so dropout draws from the global generator and
BatchNorm updates its running statistics in place, as in eager mode). Every dimension of every
input tensor is left symbolic where the model allows, so one capture serves every micro-batch
size and every length.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipeline.errors import PipeConfigError

__all__ = ["ExportError", "check_example", "export"]


# The training IR (dropout and in-place BatchNorm kept as in eager mode) is what `export`
# returns from torch 2.6; torch 2.5 returned it from `export_for_training`.
_EXPORT = (torch.export.export if hasattr(torch.export.Dim, "AUTO")
           else getattr(torch.export, "export_for_training", torch.export.export))


class ExportError(PipeConfigError):
    """torch.export could not capture the model (or captured it in a form Pipe cannot split)."""


def check_example(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`example_inputs` as (args, kwargs): a tensor, a tuple of positional arguments, a
    mapping of keyword arguments, or a pair (args tuple, kwargs mapping), as torch.export
    takes them. Any mapping is keywords: a Hugging Face collator's `BatchEncoding` is one."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if (isinstance(example_inputs, tuple) and len(example_inputs) == 2
            and isinstance(example_inputs[0], tuple)
            and isinstance(example_inputs[1], Mapping)):
        return example_inputs[0], dict(example_inputs[1])
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    raise ExportError(
        f"example_inputs must be a tensor, a tuple of positional arguments, a mapping of "
        f"keyword arguments (a dict, a BatchEncoding) or a pair (args, kwargs) (got "
        f"{type(example_inputs).__name__}); e.g. "
        f"example_inputs=((), {{'input_ids': ids}}) for model(input_ids=ids)")


def export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
           train: bool, preserve: Sequence[str] = ()) -> torch.export.ExportedProgram:
    """The model's forward in `train` (or eval) mode as an ExportedProgram, with a symbolic
    batch dimension (and the call signatures of the modules named in `preserve`); the
    model's own mode is restored afterwards."""
    was_training = model.training
    model.train(train)
    stack: list[str] = []
    try:
        with _module_stack(model, stack), _named_keywords(model, args, kwargs) as forward:
            ep = _EXPORT(model, args, kwargs, strict=False,
                         dynamic_shapes=_batch_dims(forward, args, kwargs),
                         preserve_module_call_signature=tuple(preserve))
    except ExportError:
        raise
    except Exception as exc:  # export raises many types; each becomes one clear refusal
        raise _refusal(model, stack, exc, kwargs.get("use_cache") is False) from exc
    finally:
        model.train(was_training)
    _check_batch_dim(ep, args, kwargs)
    return ep


@contextlib.contextmanager
def _named_keywords(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> Iterator[Callable[..., Any]]:
    """The model's forward, seen by export with every keyword it is given as a named
    parameter where the forward takes them through `**kwargs` (Hugging Face's flags, PEFT's
    `forward(*args, **kwargs)`): export binds the inputs to the forward's signature and then
    lays the keywords out again one by one, so a `**kwargs` parameter makes its own
    `dynamic_shapes` a tree that matches neither ("Must provide a tree_name"). An instance
    attribute `forward` with that signature, calling the model's own, is what export sees;
    the model is left as it was."""
    forward = model.forward
    try:
        signature = inspect.signature(forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"example_inputs do not fit {type(model).__name__}.forward: "
                          f"{exc}") from None
    var = [p.name for p in signature.parameters.values()
           if p.kind is inspect.Parameter.VAR_KEYWORD and p.name in bound.arguments]
    if not var:
        yield forward
        return

    def named(*a: Any, **k: Any) -> Any:
        return forward(*a, **k)
    named.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(f"_arg{i}", inspect.Parameter.POSITIONAL_ONLY)
         for i in range(len(args))]
        + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in kwargs])
    saved = model.__dict__.get("forward", _NONE)
    model.__dict__["forward"] = named
    try:
        yield named
    finally:
        if saved is _NONE:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = saved


_NONE = object()


def _batch_dims(forward: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
    """Every dimension of every tensor symbolic, keyed by the forward's parameter names as
    export wants: AUTO lets export keep a size static, or bound its range, only where the
    model needs it (`_check_batch_dim` reports a fixed batch; pipeline/splitting/shapes.py
    the rest, before each batch), so one capture serves every micro-batch size and length."""
    auto = getattr(torch.export.Dim, "AUTO", None)

    def dims(value: Any) -> Any:
        def one(v: Any) -> Any:
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                return None
            if auto is None:  # torch 2.5: no AUTO; one named batch dimension, the rest
                return {0: _BATCH}  # static (another length is captured again: lengths.py)
            return dict.fromkeys(range(v.dim()), auto)
        return pytree.tree_map(one, value)
    try:
        bound = inspect.signature(forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise ExportError(f"example_inputs do not fit the forward: {exc}") from None
    return {name: dims(value) for name, value in bound.arguments.items()}


# Before torch 2.6: one named dimension, shared by every input's dim 0.
_BATCH = None if hasattr(torch.export.Dim, "AUTO") else torch.export.Dim("batch")


def _check_batch_dim(ep: torch.export.ExportedProgram, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
    leaves = [v for v in pytree.tree_leaves((args, kwargs))
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    from torch.fx.experimental.symbolic_shapes import is_concrete_int  # imports sympy

    from pipeline.splitting.cut import user_inputs  # cut imports this module

    tensors = [node for node, _, tensor in user_inputs(ep) if tensor]
    for node, leaf in zip(tensors, leaves, strict=False):
        size = node.meta["val"].shape[0]
        # A batch dim export specialised is a SymInt with a constant value, not an int.
        if is_concrete_int(size) and leaf.shape[0] > 1:
            raise ExportError(
                f"the model fixes the batch size of input {node.name!r} to {size} (export "
                f"found code that depends on it), so its stages could not run micro-batches "
                f"of another size: remove the dependence on the batch size, or split the "
                f"model by hand into an nn.Sequential")


@contextlib.contextmanager
def _module_stack(model: nn.Module, stack: list[str]) -> Iterator[None]:
    """Keep in `stack` the names of the modules whose forward is running, innermost last, so
    a failure can name the module it happened in (non-strict export runs the model's
    Python, so hooks fire)."""
    handles = []
    for name, module in model.named_modules():
        def pre(_m: nn.Module, _a: Any, name: str = name) -> None:
            stack.append(name or type(model).__name__)

        def post(_m: nn.Module, _a: Any, _o: Any) -> None:
            if stack:
                stack.pop()
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# Frames of torch, of this package and of generated code (`<string>`) are not the user's line;
# by directory, not by a name in the path (a user's code may live in a folder `pipeline`).
_NOT_USER_CODE = (os.path.dirname(torch.__file__) + os.sep,
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, "<")


def _refusal(model: nn.Module, stack: list[str], exc: Exception, no_cache: bool = False
             ) -> ExportError:
    """The error a user sees: which module, which line of their code, what torch said, and
    the two ways forward."""
    where = stack[-1] if stack else type(model).__name__
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_NOT_USER_CODE)]
    line = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "Cache" in said and "not a known type" in said:  # a Hugging Face KV cache as output
        said = f"{said.split(', which')[0]}, which export cannot flatten " + (
            "(the model returns its key/value cache although use_cache=False: a cache passed "
            "in, as PEFT's prefix tuning passes its prefixes in past_key_values, comes back "
            "out; tune with an adapter that passes no cache, such as LoRA)" if no_cache else
            "(the model returns its key/value cache: pass use_cache=False in example_inputs)")
    drops = _layerdrop(model)
    seen = ", ".join(f"{k}={v:g}" for k, v in drops)
    zeros = ", ".join(f"{k}=0" for k, _ in drops)
    fix = (f"its config's LayerDrop ({seen}) skips layers by a random draw in Python, which "
           f"export cannot capture: set them to 0 in the config the model is built from "
           f"(from_pretrained(..., {zeros})), or split the model by hand into an "
           f"nn.Sequential of stages" if drops else
           "rewrite that construct (data-dependent Python control flow becomes torch.cond or "
           "a tensor expression), or split the model by hand into an nn.Sequential of stages "
           "and pass that to Pipe")
    return ExportError(
        f"torch.export could not capture {type(model).__name__}: in module {where!r}{line}: "
        f"{type(exc).__name__}: {said}. Pipe splits a model from its exported graph, so every "
        f"module must be exportable: {fix}")


def _layerdrop(model: nn.Module) -> list[tuple[str, float]]:
    """The model's config fields of LayerDrop that are not 0 (`encoder_layerdrop`, ...):
    modules read them when built, so the config must say 0 before the model is made."""
    config = getattr(model, "config", None)
    fields = vars(config).items() if hasattr(config, "__dict__") else ()
    return [(k, float(v)) for k, v in fields if k.endswith("layerdrop")
            and isinstance(v, int | float) and not isinstance(v, bool) and v]
