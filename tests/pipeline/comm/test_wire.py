"""pipeline.comm.wire and the receive paths: every header field a peer sends is checked first."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import example, given

from pipeline.comm.channels import RESULT, LinkChannel
from pipeline.comm.failures import PipelineAborted, Watch
from pipeline.comm.process_group import ProcessTransport
from pipeline.comm.same_host import SocketLink
from pipeline.comm.wire import (
    HEADER,
    LIMIT_ENV,
    buffer_size,
    check_limit,
    describe,
    message_limit,
    pack,
    parse,
    parts,
    read_header,
    unpack,
)
from pipeline.errors import PipeConfigError, PipelineError
from pipeline.runtime.microbatch import Packed
from tests.strategies import wire_headers, wire_values

CPU = torch.device("cpu")
MSG = ("F", 1, 0)


@pytest.mark.parametrize(("meta", "field"), [
    ((0, 1, 1, -1, 0, 1, 4), "dtype"),         # once silently complex64 (the last entry)
    ((0, 1, 1, 11, 0, 1, 4), "dtype"),         # once an IndexError
    ((0, 1, 1, 0, 0, 3, 1 << 20, 1 << 20, 1 << 20), "bytes"),  # once a 4 EiB torch.empty
    # 0 bytes, but strides of 2**90 elements: once torch.empty's "Stride calculation
    # overflowed", naming neither peer nor field
    ((0, 1, 1, 0, 0, 4, 0, 1 << 30, 1 << 30, 1 << 30), "product of the nonzero dimensions"),
    ((0, 1, 1, 0, 0, 3, 1 << 30, 0, 1 << 30), "product of the nonzero dimensions"),
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


def _same(got: tuple[Any, ...], values: tuple[Any, ...], flags: list[bool] | None = None) -> None:
    assert isinstance(got, Packed) == isinstance(values, Packed)
    assert all((g is None) == (v is None) for g, v in zip(got, values, strict=True))
    for i, (g, v) in enumerate(zip(got, values, strict=True)):
        if v is not None:
            grad = g.requires_grad if flags is None else flags[i]
            assert torch.equal(g.detach(), v.detach()) and grad == v.requires_grad
            assert g.dtype == v.dtype and g.shape == v.shape


@given(wire_values())
def test_a_flat_buffer_carries_any_values_intact(values: tuple[Any, ...]) -> None:
    # The layout over torch.distributed: one buffer, each tensor aligned after the flag.
    meta = describe(values)
    got, flags = unpack(pack(values, meta, CPU), meta)
    _same(got, values, flags)


# -- the receive path over a same-host link -----------------------------------------------------
def _receiver(sock: socket.socket) -> ProcessTransport:
    """Rank 1 of 2 receiving from rank 0 over a link, without a process group."""
    t = ProcessTransport.__new__(ProcessTransport)
    t.rank, t.world_size, t.timeout, t.device, t.group = 1, 2, 10.0, CPU, None
    t.name = lambda r: f"rank {r}"
    t._store, t._watch = None, Watch(None, [0, 1], 1)
    t._arrived, t._broken, t._polls, t._links = {}, None, False, [0]
    t._channels = {0: LinkChannel(SocketLink(sock))}
    return t


def _expect(t: ProcessTransport, *msgs: tuple[str, int, int]) -> None:
    t._channels[0].plan([], msgs)


def _flag(value: int) -> bytes:
    return struct.pack("<q", value)


def _new_shapes(header: list[int]) -> bytes:
    """What opens a stream message whose shapes changed: the flag 1 and the header."""
    return _flag(1) + struct.pack(f"<{HEADER}q", *header)


def _tensor_bytes(values: tuple[Any, ...]) -> bytes:
    """The tensors of a stream message, as they lie in memory (no padding)."""
    return b"".join(bytes(p) for p in parts(values, None)[0][1:])


@given(wire_headers())
# An integer tensor marked requires_grad: autograd would refuse it with its own message.
@example((None, [0, 1, 1, 4, 1, 0] + [0] * (HEADER - 6)))
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
            theirs.sendall(_new_shapes(header))
            with pytest.raises(PipelineError, match=r"rank 0 sent .* bad header"):
                t.wait(MSG, 0, CPU)
            return
        if values is None:  # a mutated header that is still valid: random bytes of its size
            size = sum(e[0].itemsize * torch.Size(e[2]).numel() for e in parse(meta) if e)
            data = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
        else:
            data = _tensor_bytes(values)
        theirs.sendall(_new_shapes(header) + data)
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
def test_values_cross_a_link_intact_from_the_senders_own_memory(values: tuple[Any, ...]
                                                                ) -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    sender = LinkChannel(SocketLink(theirs))
    meta = describe(values)
    _expect(t, MSG, MSG)
    # First new shapes (flag, header, tensors), then the same shapes: the flag and tensors.
    for _ in range(2):
        sender.send(MSG, values, meta)
    for _ in range(2):
        _same(t.wait(MSG, 0, CPU), values)
    t.close()
    sender.close()


class _CountingStore:
    """A store with no failure reported that counts its reads."""

    def __init__(self) -> None:
        self.reads = 0

    def check(self, keys: list[str]) -> bool:
        self.reads += 1
        return False


def test_sends_and_receives_whose_bytes_are_there_never_read_the_store() -> None:
    # Failures are checked while a wait has nothing to read (every WAKE), not on the way of
    # every message: a store read is a round trip to the process that hosts the store.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    store = _CountingStore()
    t._store, t._watch = store, Watch(store, [0, 1], 1)
    sender = LinkChannel(SocketLink(theirs))
    values = (torch.arange(6.0).reshape(2, 3),)
    _expect(t, MSG)
    sender.send(MSG, values, describe(values))
    _same(t.wait(MSG, 0, CPU), values)
    t.send(MSG, values, 0)
    assert store.reads == 0
    t.close()
    sender.close()


def test_a_non_contiguous_or_conjugate_tensor_is_sent_as_its_values() -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    sender = LinkChannel(SocketLink(theirs))
    values = (torch.arange(12.0).view(3, 4).t(),
              torch.tensor([1 + 2j], dtype=torch.complex64).conj())
    _expect(t, MSG)
    sender.send(MSG, values, describe(values))
    got = t.wait(MSG, 0, CPU)
    assert torch.equal(got[0], values[0]) and torch.equal(got[1], values[1].resolve_conj())
    t.close()
    sender.close()


def _agreed(t: ProcessTransport, theirs: socket.socket) -> bytes:
    """Send one message of new shapes (received); return the tensor bytes of the agreed
    shapes."""
    values = (torch.arange(4.0),)
    meta = describe(values)
    theirs.sendall(_new_shapes((list(meta) + [0] * HEADER)[:HEADER]) + _tensor_bytes(values))
    assert torch.equal(t.wait(MSG, 0, CPU)[0], values[0])
    return _tensor_bytes(values)


@pytest.mark.parametrize("flag", [2, 7, 1 << 40, -3, -(1 << 62)])
def test_an_unknown_flag_is_an_error_not_data(flag: int) -> None:
    # Before, any flag other than 1 or a poison was read as data: the tensors of this buffer.
    # A poison naming a rank outside the group (-3: rank 2 of 2) is unknown too.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    _expect(t, MSG, MSG)
    data = _agreed(t, theirs)
    theirs.sendall(_flag(flag) + data)
    with pytest.raises(PipelineError, match=rf"rank 0 sent .*flag {flag}.*expected"):
        t.wait(MSG, 0, CPU)
    t.close()
    theirs.close()


def test_a_poison_flag_names_the_failed_rank() -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    _expect(t, MSG, MSG)
    _agreed(t, theirs)
    theirs.sendall(_flag(-1))  # rank 0 failed: a bare flag, nothing after it
    with pytest.raises(PipelineAborted, match="rank 0 failed"):
        t.wait(MSG, 0, CPU)
    t.close()
    theirs.close()


def test_data_before_any_header_is_an_error() -> None:
    # A first message that claims to be data (flag 0) before shapes were ever agreed.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    _expect(t, MSG)
    theirs.sendall(_flag(0))
    with pytest.raises(PipelineError, match=r"rank 0 sent .*flag 0.*before"):
        t.wait(MSG, 0, CPU)
    t.close()
    theirs.close()


def test_a_result_of_another_shape_is_a_pipeline_error() -> None:
    # Before: a raw AssertionError.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    sender = LinkChannel(SocketLink(theirs))
    values = (torch.zeros(2, 3),)
    sender.send(RESULT, values, describe(values))
    with pytest.raises(PipelineError, match=r"rank 0 sent .*shape \(2, 3\).*expected \(6,\)"):
        t.recv_result(0, (6,), torch.float32)
    t.close()
    sender.close()


def test_a_header_of_zero_bytes_and_huge_dimensions_breaks_the_transport_naming_the_peer() -> None:
    # (0, 2**30, 2**30, 2**30) is 0 bytes: it passed parse, then torch.empty raised a bare
    # RuntimeError ("Stride calculation overflowed") and the transport stayed usable.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = _receiver(mine)
    _expect(t, MSG, MSG)
    meta = [0, 1, 1, 0, 0, 4, 0, 1 << 30, 1 << 30, 1 << 30]
    theirs.sendall(_new_shapes(meta + [0] * (HEADER - len(meta))))
    with pytest.raises(PipelineError, match=r"rank 0 sent .* bad header: header field product "
                                            r"of the nonzero dimensions \(entry 0\) is "
                                            rf"{1 << 90}; expected at most"):
        t.wait(MSG, 0, CPU)
    with pytest.raises(PipelineError, match="unusable after an earlier failure"):
        t.wait(MSG, 0, CPU)
    t.close()
    theirs.close()


@pytest.mark.parametrize(("raw", "limit"), [
    ("1e9", 10**9), ("2.5e9", 2_500_000_000), ("1000000", 10**6), ("1_000_000", 10**6),
    (" 4096 ", 4096), ("4611686018427387904", 1 << 62),
])
def test_the_message_bound_reads_whole_numbers_as_people_write_them(raw: str, limit: int
                                                                   ) -> None:
    assert message_limit(raw) == limit


@pytest.mark.parametrize("raw", ["lots", "1.5", "1e3", "0", "-1e9", "inf", "nan", "1e30",
                                 "1GiB"])
def test_a_bad_message_bound_is_refused_with_the_rule_the_value_and_the_fix(raw: str) -> None:
    with pytest.raises(PipeConfigError, match=(
            rf"^{LIMIT_ENV} must be a whole number of bytes from 1024 to 2\*\*62 \(an integer "
            rf"or float notation such as 1e9\); got '{raw}': set such a number, or unset it")):
        message_limit(raw)


def _import_with(raw: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, LIMIT_ENV: raw}, timeout=120)


def test_the_message_bound_never_breaks_import_pipeline() -> None:
    # Before: `PIPELINE_MAX_MESSAGE_BYTES=1e9 python -c "import pipeline"` died with a bare
    # ValueError (int('1e9')) from inside the import machinery.
    done = _import_with("1e9", "import pipeline.comm.wire as w; print(w.MAX_MESSAGE_BYTES)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(10**9)
    # A value no rule reads: import works (schedules, pipeviz, threads need no bound); the
    # process transport refuses it when it is built (check_limit), before any message.
    done = _import_with("lots", "import pipeline\nfrom pipeline.comm import wire\n"
                                "try:\n    wire.check_limit()\n"
                                "except pipeline.errors.PipeConfigError as e:\n    print(e)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{LIMIT_ENV} must be a whole number of bytes")
    check_limit()  # this process's setting is fine


def test_the_process_transport_refuses_a_bad_message_bound_before_anything_else(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Built on every rank alike, before any link or message: the one place it is raised.
    try:
        message_limit("lots")
    except PipeConfigError as exc:
        monkeypatch.setattr("pipeline.comm.wire._LIMIT_ERROR", exc)
    with pytest.raises(PipeConfigError, match=f"{LIMIT_ENV} must be .* got 'lots'"):
        ProcessTransport(0, CPU, timeout=1.0)  # no process group needed to get there
