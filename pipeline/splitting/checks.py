"""Argument and input checks for Pipe: each raises one clear error (rule, value seen, fix)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipeline.errors import PipeConfigError, PipeTypeError
from pipeline.runtime.microbatch import leading_rows

__all__ = ["check_balance_list", "check_batch", "check_batches", "check_devices",
           "check_input_rows", "check_loss_fn", "check_optimizer", "check_state_dict",
           "check_timeout"]


def check_timeout(timeout: object) -> float:
    """`timeout` as seconds: a real number > 0 (a string or NaN would disable every wait)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise PipeTypeError(f"timeout must be a number of seconds > 0 (got {timeout!r}, a "
                            f"{type(timeout).__name__}); e.g. Pipe(..., timeout=300)")
    if not timeout > 0 or math.isnan(timeout):
        raise PipeConfigError(f"timeout must be a number of seconds > 0 (got {timeout!r}); "
                              f"it bounds every wait for a peer, e.g. Pipe(..., timeout=300)")
    return float(timeout)


def check_devices(devices: Sequence[object] | None) -> None:
    """Each entry names a device torch knows ("cpu", "cuda:0", a torch.device)."""
    if devices is None:
        return
    if isinstance(devices, str | torch.device):
        raise PipeTypeError(f"devices must be a list with one device per rank (got "
                            f"{devices!r}); e.g. devices=['cpu', 'cpu']")
    for i, d in enumerate(devices):
        if isinstance(d, torch.device):
            continue
        try:
            torch.device(d)  # type: ignore[call-overload]
        except (RuntimeError, TypeError):
            raise PipeConfigError(f"devices[{i}] is {d!r}, which is not a torch device: use "
                                  f"'cpu', 'cuda:0', 'cuda:1', ... or a torch.device") from None


def check_balance_list(balance: Sequence[object]) -> None:
    """A balance list holds ints (layer counts); a string or bool would be misread."""
    for i, b in enumerate(balance):
        if isinstance(b, bool) or not isinstance(b, int):
            raise PipeTypeError(f"balance[{i}] is {b!r} (a {type(b).__name__}); a balance "
                                f"is a list of int layer counts, e.g. balance=[2, 3]")


def check_loss_fn(loss_fn: object) -> None:
    """A training step needs a loss function."""
    if not callable(loss_fn):
        raise PipeTypeError(f"loss_fn must be callable as loss_fn(output, target) -> 0-dim "
                            f"tensor (got {loss_fn!r}); e.g. pipe.step(x, y, nn.MSELoss()), or "
                            f"pipe(x) for inference without a loss")


def _type_name(value: object) -> str:
    """`list`, `int`, `numpy.ndarray`: the type as a user would write it."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__.split('.')[0]}.{kind.__qualname__}")


def _a(name: str) -> str:
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def _describe(value: object) -> str:
    """What was passed, as an error names it: 'a list', 'a 0-dim tensor', 'an int'."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-dim tensor"
    return _a(_type_name(value))


def _seen(value: object) -> str:
    """A value and its type for an error, as in 'got 5, an int' ('got None' alone)."""
    shown = repr(value)
    shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
    return shown if value is None else f"{shown}, {_describe(value)}"


def check_batch(x: Any, target: Any, chunks: int) -> None:
    """x and target (unless None: ranks without the first or last stage) each hold a tensor
    whose dim 0 is the batch; the batch has at least `chunks` rows; and the target as many
    rows as the input (a target with fewer rows would broadcast silently into a wrong loss)."""
    rows, target_rows = leading_rows(x), leading_rows(target)
    for name, value, n in (("x", x, rows), ("target", target, target_rows)):
        if value is None or n is not None:
            continue
        if isinstance(value, tuple):
            kinds = ", ".join(_type_name(v) for v in value)
            seen = f"a tuple ({kinds}) holding no tensor with a batch dimension"
        else:
            seen = _describe(value)
        raise PipeTypeError(
            f"{name} is {seen}; Pipe splits {name} along dim 0 into chunks={chunks} "
            f"micro-batches, so pass a torch.Tensor whose dim 0 is the batch (e.g. "
            f"torch.as_tensor({name})), or a tuple holding one")
    for name, n in (("input", rows), ("target", target_rows)):
        if n == 0:
            raise PipeConfigError(f"the {name} has 0 rows: a batch needs at least chunks="
                                  f"{chunks} rows (one per micro-batch)")
    if rows is not None and target_rows is not None and rows != target_rows:
        raise PipeConfigError(f"the target has {target_rows} rows but the input has {rows}: "
                              f"pass one target row per input row (dim 0 is the batch)")


def check_optimizer(optimizer: object) -> None:
    """`step_many` steps and clears gradients through the optimizer after each batch."""
    if not all(callable(getattr(optimizer, m, None)) for m in ("step", "zero_grad")):
        raise PipeTypeError(
            f"optimizer must be a torch.optim.Optimizer (with step() and zero_grad()) for "
            f"step_many to step after each batch (got {_seen(optimizer)}); "
            f"e.g. pipe.step_many(batches, loss_fn, torch.optim.SGD(pipe.parameters(), "
            f"lr=0.1)), or call pipe.step(x, target, loss_fn) per batch to step yourself")


def check_batches(batches: object) -> list[tuple[Any, Any]]:
    """`step_many`'s batches as a list of (x, target) pairs, each a tuple or list of two."""
    example = "e.g. [(x0, y0), (x1, y1)]"
    try:
        items = list(batches)  # type: ignore[call-overload]
    except TypeError:
        raise PipeTypeError(f"batches must be an iterable of (x, target) pairs (got "
                            f"{_seen(batches)}); {example}") from None
    pairs = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 2:
            seen = (f"a {type(item).__name__} of {len(item)} items"
                    if isinstance(item, tuple | list) else _describe(item))
            raise PipeTypeError(f"batches[{i}] is {seen}, not an (x, target) pair: step_many "
                                f"takes a list of pairs, {example}; for one batch use "
                                f"[(x, target)] or pipe.step(x, target, loss_fn)")
        pairs.append((item[0], item[1]))
    return pairs


def check_state_dict(own: Mapping[str, torch.Tensor], given: Mapping[str, Any],
                     strict: bool) -> None:
    """As torch's strict loading, but a `ValueError` naming every missing, unexpected and
    wrong-shape key at once. Shapes are checked whatever `strict` is, as torch does."""
    problems = []
    if strict:
        missing = sorted(set(own) - set(given))
        unexpected = sorted(set(given) - set(own))
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
    shapes = [f"{k!r}: checkpoint {tuple(given[k].shape)}, model {tuple(v.shape)}"
              for k, v in own.items() if k in given and isinstance(given[k], torch.Tensor)
              and tuple(given[k].shape) != tuple(v.shape)]
    if shapes:
        problems.append("shape mismatches " + "; ".join(shapes))
    if problems:
        raise PipeConfigError(
            "load_state_dict: the state_dict does not fit this Pipe's layers: "
            + "; ".join(problems) + ". Save it from the same model (pipe.state_dict() or "
            "model.state_dict()), or pass strict=False to skip missing and unexpected keys")


def check_input_rows(tensors: Sequence[Any], names: Sequence[str],
                     broadcast: frozenset[int]) -> None:
    """A model split from its graph: an input captured with one row (`broadcast`, over the
    batch) is passed whole to every micro-batch and must keep its one row; one captured with
    the batch's rows must have them (one row would be passed whole, where the graph wants the
    micro-batch's)."""
    rows = leading_rows(tuple(tensors)) or 0
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or rows <= 1:
            continue
        name = names[i] if i < len(names) else f"#{i}"
        if i in broadcast and t.shape[0] != 1:
            raise PipeConfigError(
                f"input {name!r} has {t.shape[0]} rows, but the model was split with 1 row of "
                f"it (broadcast over the batch, so every micro-batch takes it whole, and the "
                f"graph takes one row): pass it with 1 row, or split with example_inputs "
                f"giving it a row per example")
        if i not in broadcast and t.shape[0] == 1:
            raise PipeConfigError(
                f"input {name!r} has 1 row in a batch of {rows}, but the model was split with "
                f"a row of it per example (its graph splits it into micro-batches): pass "
                f"{rows} rows, or split with example_inputs giving it 1 row (then it is "
                f"passed whole to every micro-batch)")
