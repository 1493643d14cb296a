"""A same-host link's send buffer: a run of unread messages goes whole into the socket."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator

import pytest

from pipeline.comm.socket_link import SEND_BUFFER, SocketLink

ACTIVATION = 16 * 1024 * 4  # the reference MLP's micro-batch activation: 16 rows x 1024 fp32

# The sizes the kernel grants are Linux's rules (same-host links are Linux-only too).
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="socket buffer sizes follow Linux's rules")


def _wmem_max() -> int:
    with open("/proc/sys/net/core/wmem_max") as f:  # the most a process may ask for
        return int(f.read())


@pytest.fixture
def pair() -> Iterator[tuple[SocketLink, socket.socket]]:
    """A link and its peer's bare socket, both closed however the test ends."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = SocketLink(a)
    try:
        yield link, b
    finally:
        link.close()
        b.close()


def test_the_link_asks_for_its_send_buffer(pair: tuple[SocketLink, socket.socket]) -> None:
    link, _ = pair
    # Linux grants twice what is asked (its bookkeeping), at most twice net.core.wmem_max.
    want = 2 * min(SEND_BUFFER, _wmem_max())
    assert link._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= want


def test_a_run_of_unread_messages_is_written_by_the_callers_sendmsg(
        pair: tuple[SocketLink, socket.socket]) -> None:
    """1F1B's first rank of four, or GPipe, sends several activations before its peer reads
    one: each must go into the socket at once, with no writer thread started (a hand-off
    costs the sender a thread switch and the receiver reads in pieces)."""
    run = 8
    if _wmem_max() < SEND_BUFFER:
        pytest.skip("net.core.wmem_max caps a socket's send buffer below the link's")
    link, peer = pair
    sends = [link.send([memoryview(bytearray(8)), memoryview(bytearray(ACTIVATION))])
             for _ in range(run)]
    assert all(s.done() for s in sends)
    assert link._writer is None and link.flushed() is None
    got, want = 0, run * (8 + ACTIVATION)
    peer.settimeout(30)
    deadline = time.monotonic() + 30
    while got < want and time.monotonic() < deadline:
        got += len(peer.recv(1 << 20))
    assert got == want
