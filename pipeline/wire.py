"""The byte format of a transported message: a flag, then each tensor, described by a header."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from pipeline.microbatch import Packed

__all__ = ["ALIGN", "FLAG", "HEADER", "Meta", "buffer_size", "describe", "flag_word", "meta_length",
           "pack", "unpack"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
# int64 slots: [packed, entries, (code, dtype, requires_grad, ndim, *shape) per entry]; packed
# is 1 when the value was itself a tuple (see microbatch.Packed), so a 1-tuple stays one.
HEADER = 64
FLAG = 8  # bytes of the flag that opens every message
ALIGN = 16
Meta = tuple[int, ...]


def describe(values: tuple[Any, ...]) -> Meta:
    """The header slots of a message carrying `values` (tensors or None)."""
    meta = [int(isinstance(values, Packed)), len(values)]
    for i, v in enumerate(values):
        if v is None:
            meta += [0]
        elif isinstance(v, torch.Tensor):
            if v.dtype not in _DTYPES:
                raise TypeError(f"cannot send a {v.dtype} tensor between processes "
                                f"(entry {i}); supported: {[str(d) for d in _DTYPES]}")
            meta += [1, _DTYPES.index(v.dtype), int(v.requires_grad), v.dim(), *v.shape]
        else:
            raise TypeError(
                f"a stage output crossing processes must be tensors or None; entry {i} is a "
                f"{type(v).__name__}. Pass non-tensor settings to the layers that need them "
                f"another way (constructor arguments), or keep those layers in one stage"
            )
    if len(meta) > HEADER:
        raise ValueError(f"a message of {len(values)} entries with these shapes needs a "
                         f"{len(meta)}-slot header; at most {HEADER} fit")
    return tuple(meta)


@functools.lru_cache(maxsize=1024)  # a step sends the same few shapes again and again
def parse(meta: Meta) -> list[tuple[torch.dtype, bool, tuple[int, ...]] | None]:
    """Per entry of a header: (dtype, requires_grad, shape), or None for a None entry."""
    out: list[tuple[torch.dtype, bool, tuple[int, ...]] | None] = []
    i = 2
    for _ in range(meta[1]):
        if meta[i] == 0:
            out.append(None)
            i += 1
            continue
        dtype, grad, ndim = _DTYPES[meta[i + 1]], bool(meta[i + 2]), meta[i + 3]
        out.append((dtype, grad, tuple(meta[i + 4:i + 4 + ndim])))
        i += 4 + ndim
    return out


def _raw_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes a tensor takes in a message, padded so the next one stays aligned."""
    return -(-_raw_bytes(dtype, shape) // ALIGN) * ALIGN


@functools.lru_cache(maxsize=1024)
def buffer_size(meta: Meta | None) -> int:
    """Bytes of a message with these shapes (a bare flag while none were agreed)."""
    if meta is None:
        return FLAG
    return ALIGN + sum(_nbytes(e[0], e[2]) for e in parse(meta) if e is not None)


def _wire(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool: send the bytes


def flag_word(buf: torch.Tensor, value: int | None = None) -> int:
    """The flag that opens a message buffer (0 data, 1 new shapes follow, < 0 poison): read,
    or set to `value`."""
    if buf.device.type == "cpu":  # through numpy: a tenth of the cost of torch's indexing
        word = buf.numpy()[:FLAG].view(np.int64)
        if value is not None:
            word[0] = value
            return value
        return int(word[0])
    view = buf[:FLAG].view(torch.int64)
    if value is not None:
        view.fill_(value)
        return value
    return int(view.item())


def pack(values: tuple[Any, ...], meta: Meta, device: torch.device) -> torch.Tensor:
    """One buffer on `device` holding the flag 0 and every tensor of `values` (as `meta`)."""
    buf = torch.empty(buffer_size(meta), dtype=torch.uint8, device=device)
    flag_word(buf, 0)
    offset = ALIGN
    for v in values:
        if isinstance(v, torch.Tensor):
            size = _nbytes(v.dtype, tuple(v.shape))
            n = v.numel() * v.element_size()
            wire = v.detach().view(torch.uint8) if v.dtype == torch.bool else v.detach()
            buf[offset:offset + n].view(wire.dtype).view(v.shape).copy_(wire)
            offset += size
    return buf


def meta_length(header: list[int]) -> int:
    """How many slots of a zero-padded header `describe` wrote."""
    i = 2
    for _ in range(header[1]):
        i += 1 if header[i] == 0 else 4 + header[i + 3]
    return i


def unpack(buf: torch.Tensor, meta: Meta) -> tuple[tuple[Any, ...], list[bool]]:
    """The values a buffer of `meta` carries (views into it) and their requires-grad flags."""
    values: list[Any] = []
    flags: list[bool] = []
    offset = ALIGN
    for entry in parse(meta):
        if entry is None:
            values.append(None)
            flags.append(False)
            continue
        dtype, grad, shape = entry
        n = _raw_bytes(dtype, shape)
        t = buf[offset:offset + n].view(_wire(dtype)).view(shape)
        values.append(t.view(torch.bool) if dtype == torch.bool else t)
        flags.append(grad)
        offset += _nbytes(dtype, shape)
    packed = meta[0]
    return (Packed(values) if packed else tuple(values)), flags
