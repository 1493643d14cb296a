"""Micro-batches: split a batch along dim 0 into chunks (uneven allowed) and merge outputs back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MicroBatchError", "as_tuple", "batch_size", "gather", "scatter"]


class MicroBatchError(ValueError):
    """A batch that cannot be split into the requested micro-batches."""


def as_tuple(value: Any) -> tuple[Any, ...]:
    """A stage's inputs and outputs travel as tuples; a single value becomes a 1-tuple."""
    return value if isinstance(value, tuple) else (value,)


def batch_size(values: Sequence[Any]) -> int:
    """Rows along dim 0 shared by every tensor of `values` (non-tensors are passed through)."""
    sizes = {v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not sizes:
        raise MicroBatchError(
            "the input holds no tensor with a batch dimension to split: pass at least one "
            "tensor whose dim 0 is the batch"
        )
    if len(sizes) > 1:
        raise MicroBatchError(
            f"tensors in the input disagree on the batch size (dim 0 sizes: {sorted(sizes)}); "
            f"every tensor in the input tuple must have the same dim 0"
        )
    return sizes.pop()


def scatter(value: Any, chunks: int) -> list[tuple[Any, ...]]:
    """Split `value` (a tensor, or a tuple of tensors and non-tensors) into `chunks` micro-batches.

    Tensors split along dim 0 into near-equal parts, larger first (10 rows into 4 chunks: 3, 3,
    2, 2); non-tensors (and 0-dim tensors) are passed unchanged to every micro-batch.
    """
    values = as_tuple(value)
    size = batch_size(values)
    if chunks < 1:
        raise MicroBatchError(f"chunks must be >= 1 (got {chunks})")
    if chunks > size:
        raise MicroBatchError(
            f"cannot split a batch of {size} rows into {chunks} micro-batches: use chunks <= "
            f"{size} or a larger batch"
        )
    parts = [
        torch.tensor_split(v, chunks, dim=0) if isinstance(v, torch.Tensor) and v.dim() > 0
        else [v] * chunks
        for v in values
    ]
    return [tuple(p[i] for p in parts) for i in range(chunks)]


def gather(outputs: Sequence[tuple[Any, ...]]) -> Any:
    """Concatenate micro-batch outputs along dim 0 (non-tensors from the first micro-batch)."""
    merged = tuple(
        torch.cat([o[i] for o in outputs]) if isinstance(outputs[0][i], torch.Tensor)
        and outputs[0][i].dim() > 0 else outputs[0][i]
        for i in range(len(outputs[0]))
    )
    return merged[0] if len(merged) == 1 else merged
