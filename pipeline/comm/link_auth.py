"""Who may use a same-host link: peer credentials and a per-pair secret, checked before any data.

A link joins two ranks of one pipeline, rank `lo` listening and rank `hi` dialing. Through the
rendezvous store (trusted: see docs/security.md) `lo` announces its pid, its
socket's name and, per higher peer, a fresh 32-byte secret; `hi` announces its pid. Then:

    hi -> lo   hello:  MAGIC, hi (int64), nonce (16 bytes), HMAC(secret, "dial" lo hi nonce)
    lo -> hi   answer: HMAC(secret, "answer" lo hi nonce)

`lo` accepts a connection only if the kernel says (SO_PEERCRED) that its process runs under
our uid with the pid rank `hi` announced, `hi` is a caller it expects and has not linked yet,
and the hello proves the pair's secret; `hi` checks `lo`'s credentials the same way and uses
the link only once the answer proves the secret too. A connection that sends nothing, or too
little, is dropped after `HANDSHAKE` seconds while the others proceed (`accept`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import time

__all__ = ["ANSWER", "HANDSHAKE", "HELLO", "Refused", "accept", "answer", "check_hello",
           "check_peer", "hello", "new_secret"]

MAGIC = b"pplink1\0"
NONCE = 16
_MAC = 32  # SHA-256
HELLO = len(MAGIC) + 8 + NONCE + _MAC
ANSWER = _MAC
HANDSHAKE = 2.0  # seconds a connection has to say hello before it is dropped


class Refused(ConnectionError):
    """A connection that is not the expected peer of this pipeline."""


def new_secret() -> bytes:
    return os.urandom(32)


def _mac(secret: bytes, role: bytes, lo: int, hi: int, nonce: bytes) -> bytes:
    return hmac.new(secret, role + struct.pack("<qq", lo, hi) + nonce, hashlib.sha256).digest()


def hello(secret: bytes, hi: int, lo: int, nonce: bytes) -> bytes:
    """What rank `hi` sends rank `lo` first on a new connection."""
    return MAGIC + struct.pack("<q", hi) + nonce + _mac(secret, b"dial", lo, hi, nonce)


def answer(secret: bytes, lo: int, hi: int, nonce: bytes) -> bytes:
    """What rank `lo` sends back once it accepted rank `hi`'s hello (with `nonce`)."""
    return _mac(secret, b"answer", lo, hi, nonce)


def check_peer(sock: socket.socket, pid: int | None) -> None:
    """Raise Refused unless the process at the other end of `sock` runs under our uid (and,
    if given, has this pid): the kernel's record, which the peer cannot forge."""
    peer_pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("3i")))
    if uid != os.getuid():
        raise Refused(f"the peer runs as uid {uid}; expected {os.getuid()} (ours)")
    if pid is not None and peer_pid != pid:
        raise Refused(f"the peer is pid {peer_pid}; expected {pid}, the pid the rank "
                      f"announced")


def check_hello(sock: socket.socket, data: bytes, expected: dict[int, tuple[int, bytes]],
                lo: int) -> int:
    """The rank whose `data` (a hello read from `sock`) rank `lo` accepts, from `expected`
    (rank -> (announced pid, pair secret): callers not linked yet). Raises Refused."""
    if len(data) != HELLO or not data.startswith(MAGIC):
        raise Refused("not a link's hello")
    hi: int = struct.unpack_from("<q", data, len(MAGIC))[0]
    if hi not in expected:
        raise Refused(f"rank {hi} is not an expected caller (expected: {sorted(expected)})")
    pid, secret = expected[hi]
    check_peer(sock, pid)
    nonce = data[len(MAGIC) + 8:len(MAGIC) + 8 + NONCE]
    if not hmac.compare_digest(data[len(MAGIC) + 8 + NONCE:],
                               _mac(secret, b"dial", lo, hi, nonce)):
        raise Refused(f"the hello of rank {hi} does not prove the pair's secret")
    return hi


def accept(listener: socket.socket, expected: dict[int, tuple[int, bytes]], lo: int,
           deadline: float) -> dict[int, socket.socket]:
    """Connections of the callers in `expected` (see `check_hello`), each answered, until all
    have linked or `deadline` (monotonic) passes. Every other connection is closed: one of
    another uid at once, one whose hello is wrong when it arrives, one that sends no whole
    hello within HANDSHAKE seconds (meanwhile the others proceed)."""
    expected = dict(expected)
    linked: dict[int, socket.socket] = {}
    pending: dict[int, tuple[socket.socket, bytearray, float]] = {}  # fd -> (conn, got, until)
    poller = select.poll()
    poller.register(listener.fileno(), select.POLLIN)
    listener.setblocking(False)
    try:
        while expected:
            now = time.monotonic()
            if now >= deadline:
                break
            for fd, (_, _, until) in list(pending.items()):
                if now >= until:
                    _drop(poller, pending, fd)
            until = min([deadline, *(u for _, _, u in pending.values())])
            for fd, _ in poller.poll(max(0.0, until - now) * 1000):
                if fd == listener.fileno():
                    _take(listener, poller, pending)
                    continue
                conn, got, _ = pending[fd]
                try:
                    chunk = conn.recv(HELLO - len(got))
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    _drop(poller, pending, fd)
                    continue
                got += chunk
                if len(got) < HELLO:
                    continue
                try:
                    hi = check_hello(conn, bytes(got), expected, lo)
                    conn.setblocking(True)
                    conn.sendall(answer(expected[hi][1], lo, hi,
                                       bytes(got[len(MAGIC) + 8:len(MAGIC) + 8 + NONCE])))
                except (Refused, OSError):
                    _drop(poller, pending, fd)
                    continue
                poller.unregister(fd)
                del pending[fd]
                del expected[hi]
                linked[hi] = conn
    finally:
        for fd in list(pending):
            _drop(poller, pending, fd)
    return linked


def _take(listener: socket.socket, poller: select.poll,
          pending: dict[int, tuple[socket.socket, bytearray, float]]) -> None:
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    try:
        check_peer(conn, None)  # another uid: refused before it is read
    except (Refused, OSError):
        conn.close()
        return
    conn.setblocking(False)
    pending[conn.fileno()] = (conn, bytearray(), time.monotonic() + HANDSHAKE)
    poller.register(conn.fileno(), select.POLLIN)


def _drop(poller: select.poll, pending: dict[int, tuple[socket.socket, bytearray, float]],
          fd: int) -> None:
    conn = pending.pop(fd)[0]
    poller.unregister(fd)
    conn.close()
