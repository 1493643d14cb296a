"""Requests between a replica job's own processes, over mutual TLS under the job's certificate.

The lighthouse, the job's record and every group's manager (coordinator) talk over this, in
place of torchft's gRPC servers, which answer anyone who connects (another local user joined
quorums, fed heals, and ended ranks through the dashboard's kill and the managers' `Kill`).
A connection is TLS 1.3 with the job's certificate required and pinned at both ends (tls):
a process without the job's key completes no handshake, and a relay of the bytes reads nothing
and changes nothing (a changed byte breaks the connection; the call raises). Inside it,
requests and answers, each a JSON object behind its length (4 bytes, at most `MAX_FRAME`).
The server drops a connection whose handshake is not done within `HANDSHAKE_S` (each
connection has its own thread; at most `MAX_CONNECTIONS` are open at once, and further ones
wait to be accepted), and reads no request before it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline.errors import PipeConfigError, PipelineError
from pipeline.replicas.tls import CERT_ENV, HandshakeTimedOut, JobTLS, NotTheJob, job_tls

__all__ = ["HANDSHAKE_S", "MAX_CONNECTIONS", "MAX_FRAME", "BadRequest", "Client", "RemoteError",
           "Server", "WireBroken", "WireRefused", "WireSilent", "expect"]

_log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_FRAME = 8 << 20  # bytes of one request or answer (a quorum of many groups fits)
HANDSHAKE_S = 5.0  # seconds a connection has to complete the TLS handshake
MAX_CONNECTIONS = 256  # open at once; a further one waits in the listen queue

Handler = Callable[[dict[str, Any]], Any]  # a request to its answer (JSON data)


class WireRefused(NotTheJob):
    """The other end is not one of the job's processes (no TLS under the job's certificate)."""


class WireBroken(PipelineError, ConnectionError):
    """A connection under TLS broke mid-exchange: closed, or its bytes altered in transit."""


class WireSilent(PipelineError, TimeoutError):
    """The other end holds the connection but answered nothing in time: its process is stopped
    or held off the CPU (or, on a connection kept from before, its host is gone). `fresh`:
    the connection was made for this request, so the other end's host took it just now and
    its process still holds its listening socket (a process that is gone has it closed: the
    connection is refused)."""

    def __init__(self, message: str, *, fresh: bool) -> None:
        super().__init__(message)
        self.fresh = fresh


class RemoteError(PipelineError):
    """The server answered a request with an error."""


class BadRequest(PipeConfigError):
    """A request field of the wrong kind (the client is told which, and what came)."""


_KINDS = {str: "text", int: "a whole number", float: "a finite number", bool: "true or false",
          list: "a list", dict: "an object"}


def expect(request: dict[str, Any], name: str, kind: type) -> Any:
    """`request[name]`, if it is of `kind` (an int is a float too; a bool is neither)."""
    value = request.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise BadRequest(f"request field {name!r} must be {_KINDS[kind]}; got "
                         f"{ascii(value)[:80]}")
    return value


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


def _read_frame(sock: socket.socket, deadline: float, first: bytes = b"") -> dict[str, Any]:
    """One message, `first` its bytes already read."""
    (size,) = _LEN.unpack(first + _read(sock, _LEN.size - len(first), deadline))
    if size > MAX_FRAME:
        raise ConnectionError(f"a message of {size} bytes announced, over the bound of "
                              f"{MAX_FRAME}")
    obj = json.loads(_read(sock, size, deadline))
    if not isinstance(obj, dict):
        raise ConnectionError("a message that is not a JSON object")
    return obj


class Server:
    """Serves `handler` (a request to its answer; an exception becomes an error answer) on
    `host`:`port` to the job's processes (`tls`: the job's, from `PIPELINE_FT_CERT` by
    default), a thread per connection."""

    def __init__(self, handler: Handler, *, tls: JobTLS | None = None, host: str = "127.0.0.1",
                 port: int = 0, name: str = "pipeline-ft") -> None:
        self._handler, self._name = handler, name
        self._tls = job_tls() if tls is None else tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._slots = threading.Condition()
        self._closed = threading.Event()
        self.refused = 0  # connections that did not complete the job's handshake
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

    def _serve(self, raw: socket.socket) -> None:
        conn: socket.socket = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn = self._tls.server(raw, HANDSHAKE_S)
            except NotTheJob as exc:
                self._refuse(str(exc))
                return
            with self._slots:  # shut down by `close` under its TLS from now on
                self._open.discard(raw)
                self._open.add(conn)
            while not self._closed.is_set():
                try:
                    conn.settimeout(None)
                    first = conn.recv(1)  # waits for the next request, as long as it takes
                except OSError:
                    return
                if not first:
                    return
                # A request, once it began, arrives within the handshake's time.
                request = _read_frame(conn, time.monotonic() + HANDSHAKE_S, first)
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
                self._open.discard(raw)
                self._open.discard(conn)
                self._slots.notify_all()
            with contextlib.suppress(OSError):
                conn.close()

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
    after a failure), under TLS with the job's certificate (`tls`, as `Server`'s)."""

    def __init__(self, host: str, port: int, *, tls: JobTLS | None = None,
                 connect_timeout: float = 30.0) -> None:
        self.host, self.port = host.strip("[]"), int(port)
        self._tls = job_tls() if tls is None else tls
        self._connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, request: dict[str, Any], timeout: float) -> Any:
        """The server's answer to `request` within `timeout` seconds (TimeoutError after)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            fresh, sock = self._sock is None, self._sock or self._connect(deadline)
            self._sock = None  # kept again only after a whole exchange
            try:
                _send_frame(sock, request, deadline)
                answer = _read_frame(sock, deadline)
            except (ssl.SSLError, ConnectionError) as exc:
                sock.close()
                reason = str(getattr(exc, "reason", ""))
                if fresh and "ALERT" in reason:
                    # TLS 1.3: the server judges our certificate after the client's side of
                    # the handshake is done, and says so at the first read.
                    raise self._refused(f"it refused our certificate ({reason})") from None
                raise WireBroken(
                    f"the connection to {self.host}:{self.port} broke mid-request ({exc}): "
                    f"closed, or its bytes altered on the way; the request may not have "
                    f"been served") from None
            except TimeoutError:
                sock.close()
                raise WireSilent(
                    f"{self.host}:{self.port} took the request but answered nothing within "
                    f"{timeout:g}s (its process stopped or held off the CPU"
                    f"{'' if fresh else ', or its host gone'})", fresh=fresh) from None
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
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            return self._tls.client(sock, max(0.001, until - time.monotonic()))
        except HandshakeTimedOut as exc:  # not a refusal: its process holds the socket
            raise WireSilent(f"{self.host}:{self.port} took the connection but said nothing: "
                             f"{exc}: its process stopped or held off the CPU",
                             fresh=True) from None
        except NotTheJob as exc:
            raise self._refused(str(exc)) from None

    def _refused(self, why: str) -> WireRefused:
        return WireRefused(
            f"{self.host}:{self.port} is not one of the job's processes, or does not take us "
            f"for one: {why}; every process of one job needs the same {CERT_ENV} (torchft's "
            f"own lighthouse is not used: start the job's with `python -m "
            f"pipeline.replica_launch --record`, docs/fault-tolerance.md)")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
