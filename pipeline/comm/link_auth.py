"""Who may use a same-host link: peer credentials and a per-pair secret, checked before any data.

A link joins two ranks of one pipeline, rank `lo` listening and rank `hi` dialing. Through the
rendezvous store `lo` announces its pid, its socket's name and, per higher peer, a fresh
32-byte secret; `hi` announces its pid. Then:

    hi -> lo   hello:  MAGIC, hi (int64), nonce (16 bytes), HMAC(secret, "dial" lo hi nonce)
    lo -> hi   answer: HMAC(secret, "answer" lo hi nonce)

`lo` accepts a connection only if the kernel says (SO_PEERCRED) that its process runs under
our uid with the pid rank `hi` announced, `hi` is a caller it expects and has not linked yet,
and the hello proves the pair's secret; `hi` checks `lo`'s credentials the same way and uses
the link only once the answer proves the secret too. A connection that sends nothing, or too
little, is dropped after `HANDSHAKE` seconds while the others proceed (listener.py takes the
connections).

The store is not authenticated (docs/security.md): any local user can read the secrets and
plant records there. That is why the kernel's credentials come first: a process of another
uid is refused on them whatever it learned or planted, and a planted record can at worst
point a rank at a socket that fails the check (that pair falls back to the backend, with a
warning naming why).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

__all__ = ["ANSWER", "HANDSHAKE", "HELLO", "NONCE", "Refused", "answer", "check_hello",
           "check_mac", "check_peer", "hello", "new_secret"]

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


def check_mac(data: bytes, secrets: dict[int, bytes], lo: int) -> tuple[int, bytes]:
    """The rank and nonce of `data`, a hello to rank `lo`, if it proves the secret of that
    rank's pair (`secrets`: rank -> pair secret). Raises Refused. Needs nothing from the
    store, so a hello is checked as soon as it arrives (listener.py)."""
    if len(data) != HELLO or not data.startswith(MAGIC):
        raise Refused("not a link's hello")
    hi: int = struct.unpack_from("<q", data, len(MAGIC))[0]
    if hi not in secrets:
        raise Refused(f"rank {hi} is not an expected caller (expected: {sorted(secrets)})")
    nonce = data[len(MAGIC) + 8:len(MAGIC) + 8 + NONCE]
    if not hmac.compare_digest(data[len(MAGIC) + 8 + NONCE:],
                               _mac(secrets[hi], b"dial", lo, hi, nonce)):
        raise Refused(f"the hello of rank {hi} does not prove the pair's secret")
    return hi, nonce


def check_hello(sock: socket.socket, data: bytes, expected: dict[int, tuple[int, bytes]],
                lo: int) -> int:
    """The rank whose `data` (a hello read from `sock`) rank `lo` accepts, from `expected`
    (rank -> (announced pid, pair secret): callers not linked yet). Raises Refused."""
    hi, _ = check_mac(data, {r: secret for r, (_, secret) in expected.items()}, lo)
    check_peer(sock, expected[hi][0])
    return hi
