"""Micro-batches: split a batch along dim 0 into chunks (uneven allowed) and merge outputs back."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pipeline.errors import PipeConfigError

__all__ = ["MicroBatchError", "Packed", "as_tuple", "backward_inputs", "batch_size", "from_tuple",
           "gather", "leading_rows", "like", "scatter", "sendable", "split"]


class MicroBatchError(PipeConfigError):
    """A batch that cannot be split into the requested micro-batches (bad input, as every
    other `PipeConfigError`)."""


class Packed(tuple):  # type: ignore[type-arg]
    """The entries of a value that was itself a tuple.

    A stage's inputs and outputs travel as tuples of entries. A plain tuple of one entry stands
    for a bare value; a value that was a tuple travels as `Packed`, so a 1-tuple stays a 1-tuple
    (as in nn.Sequential, where a layer returning `(t,)` hands the next layer a 1-tuple).
    """

    __slots__ = ()


def as_tuple(value: Any) -> tuple[Any, ...]:
    """The entries `value` travels as: a tuple's own entries (`Packed`), else a 1-tuple."""
    return Packed(value) if isinstance(value, tuple) else (value,)


def from_tuple(values: tuple[Any, ...]) -> Any:
    """The value `as_tuple` made `values` from: a plain tuple for `Packed`, else the entry."""
    if isinstance(values, Packed) or len(values) != 1:
        return tuple(values)
    return values[0]


def like(values: Sequence[Any], entries: Iterable[Any]) -> tuple[Any, ...]:
    """`entries` with the structure of `values` (kept `Packed` if `values` was)."""
    return Packed(entries) if isinstance(values, Packed) else tuple(entries)


def leading_rows(value: Any) -> int | None:
    """The batch's rows in `value`: the largest dim 0 of its tensors (a tensor of one row
    beside larger ones is broadcast over them); None if no tensor has a dim 0. Unchecked."""
    sizes = [int(v.shape[0]) for v in as_tuple(value)
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return max(sizes) if sizes else None


def _whole(v: torch.Tensor, size: int) -> bool:
    """A tensor of one row in a batch of more: broadcast over the batch by the model
    (`position_ids` of shape (1, T)), so every micro-batch takes all of it, exactly."""
    return v.dim() == 0 or (v.shape[0] == 1 and size > 1)


def batch_size(values: Sequence[Any]) -> int:
    """Rows along dim 0 shared by every tensor of `values` but those of one row, which are
    broadcast (non-tensors are passed through)."""
    sizes = {v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not sizes:
        raise MicroBatchError(
            "the input holds no tensor with a batch dimension to split: pass at least one "
            "tensor whose dim 0 is the batch"
        )
    rows = sizes - {1} or sizes
    if len(rows) > 1:
        raise MicroBatchError(
            f"tensors in the input disagree on the batch size (dim 0 sizes: {sorted(sizes)}); "
            f"every tensor in the input tuple must have the same dim 0 (or 1, to be passed "
            f"whole to every micro-batch)"
        )
    return rows.pop()


def scatter(value: Any, chunks: int) -> list[tuple[Any, ...]]:
    """Split `value` (a tensor, or a tuple of tensors and non-tensors) into `chunks` micro-batches.

    Tensors split along dim 0 into near-equal parts, larger first (10 rows into 4 chunks: 3, 3,
    2, 2); non-tensors, 0-dim tensors and tensors of one row beside larger ones (broadcast over
    the batch) are passed unchanged to every micro-batch.
    """
    return split(value, chunks)[0]


def split(value: Any, chunks: int) -> tuple[list[tuple[Any, ...]], list[int]]:
    """`scatter`, and each micro-batch's rows (its `leading_rows`), known from the split."""
    values = as_tuple(value)
    size = batch_size(values)
    if chunks < 1:
        raise MicroBatchError(f"chunks must be >= 1 (got {chunks})")
    if chunks > size:
        raise MicroBatchError(
            f"cannot split a batch of {size} rows into {chunks} micro-batches: use chunks <= "
            f"{size} (for inference on a small batch, pipe(x, chunks={size})) or a larger batch"
        )
    parts = [
        torch.tensor_split(v, chunks, dim=0) if isinstance(v, torch.Tensor)
        and not _whole(v, size) else [v] * chunks
        for v in values
    ]
    # tensor_split's sizes: the first `size % chunks` parts one row more. An entry passed
    # whole has one row at most, and every part at least one: the split rows lead.
    base, extra = divmod(size, chunks)
    return ([like(values, (p[i] for p in parts)) for i in range(chunks)],
            [base + (i < extra) for i in range(chunks)])


def gather(outputs: Sequence[tuple[Any, ...]]) -> Any:
    """Concatenate micro-batch outputs along dim 0 (non-tensors from the first micro-batch)."""
    merged = like(outputs[0], (
        torch.cat([o[i] for o in outputs]) if isinstance(outputs[0][i], torch.Tensor)
        and outputs[0][i].dim() > 0 else outputs[0][i]
        for i in range(len(outputs[0]))
    ))
    return from_tuple(merged)


def backward_inputs(batches: list[Any], grads: dict[int, tuple[torch.Tensor | None, ...]],
                    chunks: int) -> None:
    """Hand each input tensor of `batches` that requires grad its gradient, from the first
    stage's per-micro-batch input gradients (keyed batch * chunks + micro-batch), as the plain
    model's backward would: into `.grad` of a leaf, on through the graph that made a non-leaf."""
    tensors: list[torch.Tensor] = []
    gradients: list[torch.Tensor] = []
    for b, x in enumerate(batches):
        size = leading_rows(x) or 0
        for i, v in enumerate(as_tuple(x)):
            if not (isinstance(v, torch.Tensor) and v.requires_grad):
                continue
            parts = [grads.get(b * chunks + k, ()) for k in range(chunks)]
            per_mb = [p[i] if i < len(p) else None for p in parts]
            if all(g is None for g in per_mb):
                continue
            if _whole(v, size):  # not split: every micro-batch saw all of it
                grad = sum(g.to(v.device) for g in per_mb if g is not None)
            else:
                pieces = torch.tensor_split(v, chunks)  # the rows `scatter` gave each
                grad = torch.cat([g.to(v.device) if g is not None else torch.zeros_like(piece)
                                  for g, piece in zip(per_mb, pieces, strict=True)])
            tensors.append(v)
            gradients.append(grad)  # type: ignore[arg-type]
    if tensors:
        torch.autograd.backward(tensors, gradients)


def sendable(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """`values` as tensors whose memory can be sent: a pending collective's result (torch's
    `AsyncCollectiveTensor`, what tensor parallelism's backward may leave as an input's
    gradient) waited for, a DTensor as its local shard; plain tensors as they are."""
    if all(type(v) is torch.Tensor or not isinstance(v, torch.Tensor) for v in values):
        return values  # the common case, without looking further
    collectives = sys.modules.get("torch.distributed._functional_collectives")
    dtensor = sys.modules.get("torch.distributed.tensor")

    def plain(v: Any) -> Any:
        if dtensor is not None and isinstance(v, dtensor.DTensor):
            v = v.to_local()
        if collectives is not None and isinstance(v, collectives.AsyncCollectiveTensor):
            v = v.wait()
        return v

    return tuple(plain(v) for v in values)
