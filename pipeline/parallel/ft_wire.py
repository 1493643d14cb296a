"""Requests between a replica job's own processes: both ends prove the job's secret first.

The lighthouse, the job's record and every group's manager (ft_coord) talk over this, in
place of torchft's gRPC servers, which answer anyone who connects (another local user joined
quorums, fed heals, and ended ranks through the dashboard's kill and the managers' `Kill`).
A connection:

    server -> client   MAGIC, server nonce (16 bytes)
    client -> server   client nonce (16 bytes), HMAC(k, "client", server nonce, client nonce)
    server -> client   HMAC(k, "server", server nonce, client nonce)

then requests and answers, each a JSON object behind its length (4 bytes, at most
`MAX_FRAME`). The server drops a connection that has not proved the secret within
`HANDSHAKE_S` (each connection has its own thread; at most `MAX_CONNECTIONS` are open at
once, and further ones wait to be accepted), and reads nothing but the proof before it; the
client uses a server only once it proved the secret too, so a planted address leads nowhere.
With no secret the key is empty and anyone passes, as in torchft.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline.errors import PipelineError
from pipeline.parallel.ft_auth import signer

__all__ = ["HANDSHAKE_S", "MAX_CONNECTIONS", "MAX_FRAME", "Client", "RemoteError", "Server",
           "WireRefused"]

_log = logging.getLogger(__name__)

MAGIC = b"pipeline-ft-wire1"
_NONCE = 16
_MAC = 32
_LEN = struct.Struct("<I")
MAX_FRAME = 8 << 20  # bytes of one request or answer (a quorum of many groups fits)
HANDSHAKE_S = 5.0  # seconds a connection has to prove the secret
MAX_CONNECTIONS = 256  # open at once; a further one waits in the listen queue

Handler = Callable[[dict[str, Any]], Any]  # a request to its answer (JSON data)


class WireRefused(PipelineError):
    """The other end did not prove the job's secret (or spoke another protocol)."""


class RemoteError(PipelineError):
    """The server answered a request with an error."""


def _mac(secret: bytes | None, side: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return signer(secret, "wire", side, server_nonce.hex(), client_nonce.hex()).digest()


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly `n` bytes by `deadline` (one deadline for the whole read: a peer dripping a
    byte at a time does not extend it)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(buf)} of {n} bytes arrived in time")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, obj: dict[str, Any], deadline: float) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"a message of {len(data)} bytes is over the bound of {MAX_FRAME}")
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(_LEN.pack(len(data)) + data)


def _read_frame(sock: socket.socket, deadline: float) -> dict[str, Any]:
    (size,) = _LEN.unpack(_read(sock, _LEN.size, deadline))
    if size > MAX_FRAME:
        raise ConnectionError(f"a message of {size} bytes announced, over the bound of "
                              f"{MAX_FRAME}")
    obj = json.loads(_read(sock, size, deadline))
    if not isinstance(obj, dict):
        raise ConnectionError("a message that is not a JSON object")
    return obj


class Server:
    """Serves `handler` (a request to its answer; an exception becomes an error answer) on
    `host`:`port` to clients that prove `secret`, a thread per connection."""

    def __init__(self, handler: Handler, *, secret: bytes | None, host: str = "127.0.0.1",
                 port: int = 0, name: str = "pipeline-ft") -> None:
        self._handler, self._secret, self._name = handler, secret, name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._slots = threading.Condition()
        self._closed = threading.Event()
        self.refused = 0  # connections that did not prove the secret
        self._thread = threading.Thread(target=self._accept, name=f"{name}-accept",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            with self._slots:  # at the bound, new connections wait in the kernel's queue
                self._slots.wait_for(lambda: len(self._open) < MAX_CONNECTIONS
                                     or self._closed.is_set())
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._slots:
                self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._handshake(conn):
                return
            while not self._closed.is_set():
                try:
                    conn.settimeout(None)
                    head = conn.recv(_LEN.size, socket.MSG_PEEK)
                except OSError:
                    return
                if not head:
                    return
                # A request, once it began, arrives within the handshake's time.
                request = _read_frame(conn, time.monotonic() + HANDSHAKE_S)
                answer: dict[str, Any]
                try:
                    answer = {"ok": self._handler(request)}
                except Exception as exc:  # the client gets it: the server goes on
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                _send_frame(conn, answer, time.monotonic() + HANDSHAKE_S)
        except (OSError, ValueError, ConnectionError, TimeoutError):
            return
        finally:
            with self._slots:
                self._open.discard(conn)
                self._slots.notify_all()
            with contextlib.suppress(OSError):
                conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        deadline = time.monotonic() + HANDSHAKE_S
        server_nonce = secrets.token_bytes(_NONCE)
        try:
            conn.settimeout(HANDSHAKE_S)
            conn.sendall(MAGIC + server_nonce)
            hello = _read(conn, _NONCE + _MAC, deadline)
        except (OSError, TimeoutError, ConnectionError):
            self._refuse("it did not complete the handshake in time")
            return False
        client_nonce, proof = hello[:_NONCE], hello[_NONCE:]
        if not hmac.compare_digest(proof, _mac(self._secret, "client", server_nonce,
                                               client_nonce)):
            self._refuse("it did not prove the job's secret")
            return False
        conn.sendall(_mac(self._secret, "server", server_nonce, client_nonce))
        return True

    def _refuse(self, why: str) -> None:
        self.refused += 1
        _log.warning("%s: a connection refused (%s): only the job's own processes are served",
                     self._name, why)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._slots:
            self._slots.notify_all()
            for conn in list(self._open):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5.0)


class Client:
    """Requests to a `Server` at `host`:`port`, one at a time on one connection (made again
    after a failure), the server proving `secret` before the first."""

    def __init__(self, host: str, port: int, *, secret: bytes | None,
                 connect_timeout: float = 30.0) -> None:
        self.host, self.port = host.strip("[]"), int(port)
        self._secret, self._connect_timeout = secret, connect_timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, request: dict[str, Any], timeout: float) -> Any:
        """The server's answer to `request` within `timeout` seconds (TimeoutError after)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            sock = self._sock or self._connect(deadline)
            self._sock = None  # kept again only after a whole exchange
            try:
                _send_frame(sock, request, deadline)
                answer = _read_frame(sock, deadline)
            except BaseException:
                sock.close()
                raise
            self._sock = sock
        if "error" in answer:
            raise RemoteError(str(answer["error"]))
        return answer.get("ok")

    def _connect(self, deadline: float) -> socket.socket:
        until = min(deadline, time.monotonic() + self._connect_timeout)
        while True:
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=max(0.001, until - time.monotonic()))
                break
            except OSError:
                if time.monotonic() >= until:
                    raise
                time.sleep(0.1)  # the server may be starting
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                greeting = _read(sock, len(MAGIC), until)
            except ConnectionError:
                greeting = b""
            if greeting != MAGIC:
                raise WireRefused(
                    f"{self.host}:{self.port} does not speak this library's protocol (torchft's "
                    f"own lighthouse is not used: start the job's with `python -m "
                    f"pipeline.replica_launch --record`, docs/fault-tolerance.md)")
            server_nonce, client_nonce = _read(sock, _NONCE, until), secrets.token_bytes(_NONCE)
            sock.sendall(client_nonce + _mac(self._secret, "client", server_nonce,
                                             client_nonce))
            try:
                answer = _read(sock, _MAC, until)
            except ConnectionError:
                answer = b""
            if not hmac.compare_digest(answer, _mac(self._secret, "server", server_nonce,
                                                    client_nonce)):
                raise WireRefused(
                    f"{self.host}:{self.port} did not prove the job's secret (or refused "
                    f"ours): every process of one job needs the same PIPELINE_FT_SECRET")
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
