"""A same-host link's send buffer: a run of unread messages goes whole into the socket."""

from __future__ import annotations

import socket
import time

import pytest

from pipeline.comm.socket_link import SEND_BUFFER, SocketLink

ACTIVATION = 16 * 1024 * 4  # the reference MLP's micro-batch activation: 16 rows x 1024 fp32


def _wmem_max() -> int:
    with open("/proc/sys/net/core/wmem_max") as f:  # the most a process may ask for
        return int(f.read())


def _pair() -> tuple[SocketLink, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return SocketLink(a), b


def test_the_link_asks_for_its_send_buffer() -> None:
    link, _peer = _pair()
    # Linux grants twice what is asked (its bookkeeping), at most twice net.core.wmem_max.
    want = 2 * min(SEND_BUFFER, _wmem_max())
    assert link._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= want
    link.close()


def test_a_run_of_unread_messages_is_written_by_the_callers_sendmsg() -> None:
    """1F1B's first rank of four, or GPipe, sends several activations before its peer reads
    one: each must go into the socket at once, with no writer thread started (a hand-off
    costs the sender a thread switch and the receiver reads in pieces)."""
    run = 8
    if _wmem_max() < SEND_BUFFER:
        pytest.skip("net.core.wmem_max caps a socket's send buffer below the link's")
    link, peer = _pair()
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
    link.close()
    peer.close()
