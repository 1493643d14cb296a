"""The byte format of a transported message: a flag, then each tensor, described by a header.

Two layouts carry it. Over a stream (a same-host link) a message is the flag, the header when
the shapes changed, then each tensor's bytes as they lie in memory: written with one
scatter-gather call from the tensors themselves (`parts`) and read straight into the
destination tensors (`allocate`). Over torch.distributed a message is one flat buffer (`pack`,
`unpack`): the flag, then each tensor 16-byte aligned; the header travels apart.

Headers come from another process, so every field is checked before it is used (`parse`,
`read_header`): a bad one raises `BadHeader` (a `PipelineError`) naming the field, the value
seen and what was expected; the transport adds which peer sent it. Checks are integer
comparisons, once per distinct header (`parse` is cached).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from typing import Any

import numpy as np
import torch

from pipeline import settings
from pipeline.errors import PipeConfigError, PipelineError
from pipeline.runtime.microbatch import Packed

__all__ = [
    "ALIGN",
    "DATA",
    "FLAG",
    "HEADER",
    "MAX_MESSAGE_BYTES",
    "SHAPES",
    "BadHeader",
    "Meta",
    "allocate",
    "buffer_size",
    "check_limit",
    "describe",
    "flag_word",
    "header_bytes",
    "memory",
    "message_limit",
    "pack",
    "parse",
    "parts",
    "read_header",
    "read_header_bytes",
    "unpack",
]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
# int64 slots: [packed, entries, (code, dtype, requires_grad, ndim, *shape) per entry]; packed
# is 1 when the value was itself a tuple (see microbatch.Packed), so a 1-tuple stays one.
HEADER = 64
FLAG = 8  # bytes of the flag that opens every message
DATA, SHAPES = 0, 1  # flags: the agreed shapes; new shapes (the header follows). < 0: poison
ALIGN = 16
Meta = tuple[int, ...]
LIMIT_ENV = "PIPELINE_MAX_MESSAGE_BYTES"


def _memory_bytes() -> int:
    """This machine's memory: no message larger than it can ever be received."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 1 << 40


_MIN_LIMIT, _MAX_LIMIT = 1024, 1 << 62  # above 2**62, byte counts near int64's end


def message_limit(raw: str | None) -> int:
    """The bound `PIPELINE_MAX_MESSAGE_BYTES` = `raw` sets (None or empty: this machine's
    memory). A whole number of bytes, written as an integer or in float notation (`1e9`,
    `2.5e9`: what people write for large numbers, and exact there), by the settings' rule
    (`pipeline.settings`); raises PipeConfigError for anything else."""
    limit = settings.whole_number(LIMIT_ENV, default=None, low=_MIN_LIMIT, high=_MAX_LIMIT,
                                  of="bytes", high_text="2**62",
                                  environ={LIMIT_ENV: raw} if raw is not None else {})
    return _memory_bytes() if limit is None else limit


def _initial_limit() -> tuple[int, PipeConfigError | None]:
    # Read at import but never raised there: `import pipeline` (for schedules, pipeviz, a
    # single-process Pipe, none of which parses a header) must not die of a setting only the
    # process transport uses, with a traceback through the import machinery. The transport
    # raises it when it is built (check_limit), on every rank, before any message moves.
    try:
        return message_limit(os.environ.get(LIMIT_ENV)), None
    except PipeConfigError as exc:
        return _memory_bytes(), exc


# The largest message a receiver allocates (a header declaring more is refused, not allocated).
MAX_MESSAGE_BYTES, _LIMIT_ERROR = _initial_limit()


def check_limit() -> None:
    """Raise the PipeConfigError of a bad `PIPELINE_MAX_MESSAGE_BYTES`, if it was set so."""
    if _LIMIT_ERROR is not None:
        raise _LIMIT_ERROR


class BadHeader(PipelineError):
    """A message header that no sender of ours writes; the transport names the peer."""


def _check(ok: bool, field: str, value: int, expected: str) -> None:
    if not ok:
        raise BadHeader(f"header field {field} is {value}; expected {expected}")


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
    """Per entry of a header: (dtype, requires_grad, shape), or None for a None entry.
    Raises `BadHeader` for a field out of its range, a header longer or shorter than its
    entries, or a message above `MAX_MESSAGE_BYTES`."""
    n = len(meta)
    _check(2 <= n <= HEADER, "length", n, f"2 to {HEADER} slots")
    _check(meta[0] in (0, 1), "packed", meta[0], "0 or 1")
    _check(0 <= meta[1] <= HEADER - 2, "entries", meta[1], f"0 to {HEADER - 2}")
    out: list[tuple[torch.dtype, bool, tuple[int, ...]] | None] = []
    i, total = 2, ALIGN
    for k in range(meta[1]):
        _check(i < n, "length", n, f"more slots: the header ends before entry {k}")
        _check(meta[i] in (0, 1), f"entry kind (entry {k})", meta[i], "0 (None) or 1 (tensor)")
        if meta[i] == 0:
            out.append(None)
            i += 1
            continue
        _check(i + 4 <= n, "length", n, f"more slots: the header ends inside entry {k}")
        code, grad, ndim = meta[i + 1], meta[i + 2], meta[i + 3]
        _check(0 <= code < len(_DTYPES), f"dtype (entry {k})", code,
               f"0 to {len(_DTYPES) - 1} ({', '.join(str(d)[6:] for d in _DTYPES)})")
        _check(grad in (0, 1), f"requires_grad (entry {k})", grad, "0 or 1")
        # Only floating and complex tensors can require grad: a 1 on an integer tensor would
        # fail later, inside autograd, with torch's message instead of the peer's name.
        dtype = _DTYPES[code]
        _check(grad == 0 or dtype.is_floating_point or dtype.is_complex,
               f"requires_grad (entry {k})", grad, f"0 for {str(dtype)[6:]} (only "
               f"floating and complex tensors carry gradients)")
        _check(0 <= ndim <= n - i - 4, f"ndim (entry {k})", ndim,
               f"0 to {n - i - 4} (the slots left in the header)")
        shape = meta[i + 4:i + 4 + ndim]
        size = itemsize = dtype.itemsize
        elements = 1
        for d, dim in enumerate(shape):
            _check(0 <= dim <= MAX_MESSAGE_BYTES, f"dimension {d} (entry {k})", dim,
                   f"0 to {MAX_MESSAGE_BYTES}")
            size *= dim
            elements *= max(dim, 1)
        total += -(-size // ALIGN) * ALIGN
        _check(total <= MAX_MESSAGE_BYTES, "bytes", total,
               f"at most {MAX_MESSAGE_BYTES} (the bound on a message; {LIMIT_ENV} sets it)")
        # A zero dimension makes the byte count 0 whatever the others are, but torch still
        # computes strides from them: (0, 2**30, 2**30, 2**30) overflows them. So the
        # nonzero dimensions are bounded as if the zero were a one (without a zero, this is
        # the byte count checked above).
        _check(elements * itemsize <= MAX_MESSAGE_BYTES,
               f"product of the nonzero dimensions (entry {k})", elements,
               f"at most {MAX_MESSAGE_BYTES // itemsize} ({str(dtype)[6:]} elements within the "
               f"bound on a message, {LIMIT_ENV}, even when another dimension is 0)")
        out.append((_DTYPES[code], bool(grad), tuple(shape)))
        i += 4 + ndim
    _check(i == n, "length", n, f"{i} slots (what the entries take)")
    return out


def read_header(header: list[int]) -> Meta:
    """The header slots `describe` wrote, out of a received zero-padded header of `HEADER`
    slots; checked by `parse`. Raises `BadHeader`."""
    _check(len(header) == HEADER, "length", len(header), f"{HEADER} slots")
    i = 2
    entries = header[1]
    _check(0 <= entries <= HEADER - 2, "entries", entries, f"0 to {HEADER - 2}")
    for k in range(entries):
        _check(i + 1 <= HEADER, "length", HEADER, f"more slots: entry {k} does not fit")
        _check(header[i] in (0, 1), f"entry kind (entry {k})", header[i],
               "0 (None) or 1 (tensor)")
        if header[i] == 0:
            i += 1
            continue
        _check(i + 4 <= HEADER, "length", HEADER, f"more slots: entry {k} does not fit")
        ndim = header[i + 3]
        _check(0 <= ndim <= HEADER - i - 4, f"ndim (entry {k})", ndim,
               f"0 to {HEADER - i - 4} (the slots left in the header)")
        i += 4 + ndim
    padding = header[i:]
    _check(not any(padding), "padding", next((v for v in padding if v), 0),
           f"zeros after slot {i}")
    meta = tuple(header[:i])
    parse(meta)
    return meta


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


# -- the stream layout ------------------------------------------------------------------------
_FLAG_DATA = struct.pack("<q", DATA)


def memory(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, shared (not copied), writable, whatever its dtype. The
    view does not keep the tensor alive: its caller does."""
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())).cast("B")


def header_bytes(meta: Meta) -> bytes:
    """The flag SHAPES and the zero-padded header of `meta`, as a stream message opens."""
    return struct.pack(f"<q{HEADER}q", SHAPES, *meta, *([0] * (HEADER - len(meta))))


def read_header_bytes(raw: bytes | bytearray | memoryview) -> Meta:
    """The header of a stream message (`HEADER` little-endian int64 slots), checked."""
    return read_header(list(struct.unpack(f"<{HEADER}q", raw)))


def parts(values: tuple[Any, ...], meta: Meta | None
          ) -> tuple[list[memoryview], list[torch.Tensor]]:
    """A stream message of `values` without copying them: the flag (with the header `meta`
    when given: the shapes changed) and each tensor's own memory; and the tensors that own
    that memory (aliases: releasing a stage output's `.data` leaves them intact).
    Non-contiguous tensors and conjugate views are copied first (their memory is not the
    bytes), and so are tensors on another device than the host's (a stream carries host
    memory: CUDA ranks over gloo)."""
    out = [memoryview(_FLAG_DATA if meta is None else header_bytes(meta))]
    keep = []
    for v in values:
        if isinstance(v, torch.Tensor):
            t = v.detach() if v.device.type == "cpu" else v.detach().cpu()
            if not t.is_contiguous() or t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg().contiguous()
            keep.append(t)
            out.append(memory(t))
    return out, keep


def allocate(meta: Meta) -> tuple[tuple[Any, ...], list[bool], list[memoryview]]:
    """Empty tensors of the shapes `meta` describes (checked by `parse`), their requires-grad
    flags, and their memory to receive a stream message's bytes into."""
    values: list[Any] = []
    flags: list[bool] = []
    views: list[memoryview] = []
    for entry in parse(meta):
        if entry is None:
            values.append(None)
            flags.append(False)
            continue
        dtype, grad, shape = entry
        t = torch.empty(shape, dtype=dtype)
        values.append(t)
        flags.append(grad)
        views.append(memory(t))
    return (Packed(values) if meta[0] else tuple(values)), flags, views
