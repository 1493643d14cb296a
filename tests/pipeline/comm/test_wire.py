"""pipeline.comm.wire and the receive path: every header field a peer sends is checked first."""

from __future__ import annotations

import socket
from collections import deque
from typing import Any

import pytest
import torch
from hypothesis import given

from pipeline.comm.process_group import ProcessTransport
from pipeline.comm.same_host import SocketLink
from pipeline.comm.transport import PipelineAborted
from pipeline.comm.wire import (
    FLAG,
    HEADER,
    buffer_size,
    describe,
    flag_word,
    pack,
    parse,
    read_header,
)
from pipeline.errors import PipelineError
from pipeline.runtime.microbatch import Packed
from tests.strategies import wire_headers, wire_values

CPU = torch.device("cpu")
MSG = ("F", 1, 0)


@pytest.mark.parametrize(("meta", "field"), [
    ((0, 1, 1, -1, 0, 1, 4), "dtype"),         # once silently complex64 (the last entry)
    ((0, 1, 1, 11, 0, 1, 4), "dtype"),         # once an IndexError
    ((0, 1, 1, 0, 0, 3, 1 << 20, 1 << 20, 1 << 20), "bytes"),  # once a 4 EiB torch.empty
    ((0, 1, 1, 0, 0, 1, -4), "dimension 0"),
    ((0, 1, 1, 0, 0, -1), "ndim"),
    ((0, 1, 1, 0, 0, 9, 4), "ndim"),            # more dimensions than the header holds
    ((0, 1, 1, 0, 2, 1, 4), "requires_grad"),
    ((0, 1, 2, 0, 0, 1, 4), "entry kind"),
    ((2, 1, 0), "packed"),
    ((0, -1), "entries"),
    ((0, 100), "entries"),
    ((0, 2, 0), "length"),                       # the header ends inside entry 1
    ((0, 1, 0, 5), "length"),                    # a slot after the last entry
])
def test_parse_rejects_every_bad_field_by_name(meta: tuple[int, ...], field: str) -> None:
    with pytest.raises(PipelineError, match=field):
        parse(meta)


def test_a_message_above_the_byte_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = describe((torch.zeros(4, 4),))
    parse.cache_clear()
    monkeypatch.setattr("pipeline.comm.wire.MAX_MESSAGE_BYTES", 32)
    try:
        with pytest.raises(PipelineError, match=r"bytes is 80; expected at most 32"):
            buffer_size(meta)
    finally:
        parse.cache_clear()
        buffer_size.cache_clear()


@given(wire_headers())
def test_any_header_parses_consistently_or_raises_pipeline_error(
        case: tuple[tuple[Any, ...] | None, list[int]]) -> None:
    values, header = case
    try:
        meta = read_header(header)
    except PipelineError:
        assert values is None, "a header describe wrote was refused"
        return
    if values is not None:
        assert meta == describe(values)
    # What parse accepts describes exactly the tensors that unpack will make: written back
    # from them, it is the same header (no field ignored, none read from a wrong slot).
    entries = parse(meta)
    again = [meta[0], len(entries)]
    for e in entries:
        again += [0] if e is None else [1, _index(e[0]), int(e[1]), len(e[2]), *e[2]]
    assert tuple(again) == meta
    assert buffer_size(meta) <= 1 << 40


def _index(dtype: torch.dtype) -> int:
    return describe((torch.zeros(0, dtype=dtype),))[3]


# -- the receive path ---------------------------------------------------------------------------
def _receiver(sock: socket.socket) -> ProcessTransport:
    """Rank 1 of 2 receiving from rank 0 over a link, without a process group."""
    t = ProcessTransport.__new__(ProcessTransport)
    t.rank, t.world_size, t.timeout, t.device, t.group = 1, 2, 10.0, CPU, None
    t.name = lambda r: f"rank {r}"
    t._global, t._watch, t._comm_device, t._store = [0, 1], [0, 1], CPU, None
    t._sent_meta, t._recv_meta, t._pending, t._posted, t._arrived = {}, {}, [], {}, {}
    t._expected, t._to_send = {}, {}
    t._polls, t._last_check, t._broken = False, [0.0], None
    t._links = {0: SocketLink(sock)}
    return t


def _expect(t: ProcessTransport, *msgs: tuple[str, int, int]) -> None:
    t._expected = {0: deque(msgs)}
    t._post_next(0)


def _send_raw(sock: socket.socket, *parts: torch.Tensor) -> None:
    for part in parts:
        sock.sendall(part.numpy().tobytes())


def _new_shapes(header: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    notice = torch.zeros(FLAG, dtype=torch.uint8)
    flag_word(notice, 1)
    return notice, torch.tensor(header, dtype=torch.int64)


@given(wire_headers())
def test_the_receive_path_returns_what_was_sent_or_raises_pipeline_error(
        case: tuple[tuple[Any, ...] | None, list[int]]) -> None:
    values, header = case
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    try:
        _expect(t, MSG)
        try:
            meta = read_header(header)
        except PipelineError:
            meta = None
        if meta is None:  # refused: nothing follows the header, and nothing is waited for
            _send_raw(theirs, *_new_shapes(header))
            with pytest.raises(PipelineError, match=r"rank 0 sent .* bad header"):
                t.wait(MSG, 0, CPU)
            return
        if values is None:  # a mutated header that is still valid: random bytes of its size
            data = torch.randint(0, 256, (buffer_size(meta),), dtype=torch.uint8)
            flag_word(data, 0)
        else:
            data = pack(values, meta, CPU)
        _send_raw(theirs, *_new_shapes(header), data)
        got = t.wait(MSG, 0, CPU)
        assert isinstance(got, Packed) == bool(meta[0])
        entries = parse(meta)
        assert len(got) == len(entries)
        for g, e, v in zip(got, entries, values or [None] * len(entries), strict=True):
            if e is None:
                assert g is None
                continue
            assert (g.dtype, g.requires_grad, tuple(g.shape)) == e
            if v is not None:
                assert torch.equal(g.detach(), v.detach())
    finally:
        t.close()
        theirs.close()


@given(wire_values())
def test_values_cross_the_receive_path_intact(values: tuple[Any, ...]) -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    meta = describe(values)
    _expect(t, MSG, MSG)
    header = (list(meta) + [0] * HEADER)[:HEADER]
    # First new shapes, then the same shapes again: the bare message in the agreed buffer.
    _send_raw(theirs, *_new_shapes(header), pack(values, meta, CPU), pack(values, meta, CPU))
    for _ in range(2):
        got = t.wait(MSG, 0, CPU)
        assert all((g is None) == (v is None) for g, v in zip(got, values, strict=True))
        assert all(torch.equal(g.detach(), v.detach()) and g.requires_grad == v.requires_grad
                   for g, v in zip(got, values, strict=True) if v is not None)
    t.close()
    theirs.close()


def _agreed(t: ProcessTransport, theirs: socket.socket) -> torch.Tensor:
    """Send one message of new shapes (received), and return a buffer of the agreed size."""
    values = (torch.arange(4.0),)
    meta = describe(values)
    _send_raw(theirs, *_new_shapes((list(meta) + [0] * HEADER)[:HEADER]),
              pack(values, meta, CPU))
    assert torch.equal(t.wait(MSG, 0, CPU)[0], values[0])
    return pack(values, meta, CPU)


@pytest.mark.parametrize("flag", [2, 7, 1 << 40, -3, -(1 << 62)])
def test_an_unknown_flag_is_an_error_not_data(flag: int) -> None:
    # Before, any flag other than 1 or a poison was read as data: the tensors of this buffer.
    # A poison naming a rank outside the group (-3: rank 2 of 2) is unknown too.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    _expect(t, MSG, MSG)
    buf = _agreed(t, theirs)
    flag_word(buf, flag)
    _send_raw(theirs, buf)
    with pytest.raises(PipelineError, match=rf"rank 0 sent .*flag {flag}.*expected"):
        t.wait(MSG, 0, CPU)
    t.close()
    theirs.close()


def test_a_poison_flag_names_the_failed_rank() -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    _expect(t, MSG, MSG)
    buf = _agreed(t, theirs)
    flag_word(buf, -1)  # rank 0 failed
    _send_raw(theirs, buf)
    with pytest.raises(PipelineAborted, match="rank 0 failed"):
        t.wait(MSG, 0, CPU)
    t.close()
    theirs.close()


def test_data_before_any_header_is_an_error() -> None:
    # A first message that claims to be data (flag 0) before shapes were ever agreed.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    _expect(t, MSG)
    _send_raw(theirs, torch.zeros(FLAG, dtype=torch.uint8))
    with pytest.raises(PipelineError, match=r"rank 0 sent .*flag 0.*before"):
        t.wait(MSG, 0, CPU)
    t.close()
    theirs.close()


def test_a_result_of_another_shape_is_a_pipeline_error() -> None:
    # Before: a raw AssertionError.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    values = (torch.zeros(2, 3),)
    meta = describe(values)
    _send_raw(theirs, *_new_shapes((list(meta) + [0] * HEADER)[:HEADER]),
              pack(values, meta, CPU))
    with pytest.raises(PipelineError, match=r"rank 0 sent .*shape \(2, 3\).*expected \(6,\)"):
        t.recv_result(0, (6,), torch.float32)
    t.close()
    theirs.close()
