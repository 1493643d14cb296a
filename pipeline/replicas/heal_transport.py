"""The heal transport: a peer's checkpoint over HTTP inside the job's mutual TLS, single-use.

torchft's HTTPTransport binds every interface, serves `/checkpoint/<step>/full` to anyone,
unpickles what it fetches with `weights_only=False`, and reads it with a timeout per socket
operation only (a peer sending a byte a second was still being read after 30 s of a 3 s
timeout). This one, in its place (`checkpoint_transport=` of torchft's Manager), over a TLS
connection with the job's certificate required and pinned at both ends (tls), one request
per connection:

    healing rank -> source   GET /checkpoint/<step>/full?nonce=N&source=HOST:PORT
    source -> healing rank   200, Content-Length: n, X-Pipeline-Source: HOST:PORT,
                             X-Pipeline-Nonce: N; the checkpoint (n bytes, torch's streaming
                             format)

`source` is the address the quorum named (the metadata the healing rank was given): a source
serves a request naming itself alone (421 otherwise), and each nonce once (409 for a second
request with it: a heal request is single-use), and a field that is not what it must be is
refused by name (400). The healing rank reads only from the source it was pointed at (the
answer must name that source and echo its nonce), refuses a body over the size bound, reads
the whole answer within one deadline, loads it with `weights_only=True`, and refuses a
checkpoint whose step is not the quorum's. A refusal raises `HealRefused`: torchft's Manager
records it (report_error), applies nothing and commits no step.
"""

from __future__ import annotations

import http.server
import io
import logging
import os
import re
import secrets
import socket
import ssl
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import torch
from torch.distributed._serialization import _streaming_load, _streaming_save
from torch.utils._pytree import tree_map_only
from torchft.checkpointing import CheckpointTransport

from pipeline.errors import PipeConfigError, PipelineError
from pipeline.replicas.auth import bind_host, host_port
from pipeline.replicas.tls import JobTLS, NotTheJob, job_tls

__all__ = ["HealRefused", "HealTransport", "check_same_model"]

_log = logging.getLogger(__name__)

_HEAD_LIMIT = 64 * 1024  # bytes of an answer's status line and headers
_SOURCE, _NONCE = "X-Pipeline-Source", "X-Pipeline-Nonce"
_NONCE_FORM = re.compile(r"[0-9a-f]{32}")
_SAY_HELLO_S = 5.0  # the handshake, and a request's line and headers, arrive within this
_REMEMBERED = 1 << 16  # nonces a source keeps (the oldest forgotten first)


class HealRefused(PipelineError):
    """A heal's source or answer that the job does not accept (not one of the job's
    processes, not the source named, a request used before, too slow, too large, another
    step)."""


class HealTransport(CheckpointTransport[dict[str, Any]]):  # type: ignore[misc]
    """torchft's checkpoint transport (send_checkpoint, recv_checkpoint, metadata), its
    server bound to `host`, every connection TLS under the job's certificate (`tls`)."""

    def __init__(self, timeout: timedelta, *, tls: JobTLS | None = None,
                 host: str | None = None, max_bytes: int | None = None) -> None:
        from pipeline.comm import wire

        self._tls = job_tls() if tls is None else tls
        self._timeout = timeout
        # A heal is a message from a peer: the same bound (the machine's memory, or
        # PIPELINE_MAX_MESSAGE_BYTES).
        self._max_bytes = (wire.message_limit(os.environ.get(wire.LIMIT_ENV))
                           if max_bytes is None else max_bytes)
        self._ready = threading.Condition()
        self._step = -1
        self._payload: bytes | None = None  # the checkpoint served, saved once per step
        self._used: OrderedDict[str, None] = OrderedDict()  # nonces served (single-use)
        # The steps of the heals this rank began, in order: its FaultTolerance checks each
        # one was applied whole (heal).
        self.heals: list[int] = []
        host = bind_host() if host is None else host
        server_class = _Server6 if ":" in host else _Server
        self._server = server_class((host, 0), _handler(self))
        self._server.tls = self._tls
        self.source = host_port(host, self._server.server_address[1])  # what requests name
        self._address = f"https://{self.source}/checkpoint/"
        # Polled 10 times a second for shutdown (not 2): a closing rank waits less.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,),
                                        daemon=True, name="heal-transport")
        self._thread.start()

    # -- the source's side ---------------------------------------------------------------------
    def metadata(self) -> str:
        return self._address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        # Saved now, on CPU: what the peers read is this step's state, whatever the
        # optimizer does to the tensors after.
        buffer = io.BytesIO()
        _streaming_save(tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), state_dict),
                        buffer)
        with self._ready:
            self._step, self._payload = step, buffer.getvalue()
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._step, self._payload = -1, None

    def _check(self, nonce: str, source: str) -> tuple[int, str] | None:
        """The refusal (status, why) of a request's nonce and source, if any; a nonce
        taken is used up, whatever follows."""
        if not _NONCE_FORM.fullmatch(nonce):
            return 400, f"nonce must be 32 hex digits, fresh for each request; got {nonce!r}"
        if source != self.source:
            return 421, f"this request is for source {source!r}; this source is {self.source}"
        with self._ready:
            if nonce in self._used:
                return 409, (f"request {nonce} was served already: a heal request is "
                             f"single-use")
            self._used[nonce] = None
            while len(self._used) > _REMEMBERED:
                self._used.popitem(last=False)
        return None

    def _serve(self, step: int) -> bytes:
        """The checkpoint of `step`, once it is ready (waiting up to the timeout)."""
        with self._ready:
            self._ready.wait_for(lambda: self._step == step,
                                 timeout=self._timeout.total_seconds())
            payload = self._payload if self._step == step else None
        if payload is None:
            raise HealRefused(f"no checkpoint of step {step} to serve within "
                              f"{self._timeout.total_seconds():g}s (serving {self._step})")
        return payload

    # -- the healing rank's side ---------------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> dict[str, Any]:
        self.heals.append(step)
        url = urlsplit(metadata)
        if url.scheme != "https" or url.hostname is None or url.port is None:
            raise HealRefused(f"the heal source's address {metadata!r} is not "
                              f"https://host:port/checkpoint/, as this library's sources give")
        source = host_port(url.hostname, url.port)
        query = urlencode({"nonce": secrets.token_hex(16), "source": source})
        state = self._load_from_address(f"{metadata}{step}/full?{query}", timeout)
        own = state.get("torchft") if isinstance(state, dict) else None
        held = own.get("step") if isinstance(own, dict) else None
        if held != step:
            raise HealRefused(f"the heal source at {metadata!r} holds step {held!r}, not the "
                              f"quorum's step {step}: not applied")
        return state  # type: ignore[no-any-return]

    def _load_from_address(self, address: str, timeout: timedelta) -> Any:
        """The checkpoint at `address` (a URL naming its step, nonce and source), read in full
        within `timeout`, checked, then loaded as plain data. Raises HealRefused (logged)."""
        try:
            return self._load(address, time.monotonic() + timeout.total_seconds())
        except HealRefused as exc:
            _log.warning("heal refused, nothing applied: %s", exc)
            raise

    def _load(self, address: str, deadline: float) -> Any:
        url = urlsplit(address)
        query = parse_qs(url.query)
        name = address.split("?")[0]
        if url.hostname is None or url.port is None:
            raise HealRefused(f"the heal source's address {name!r} names no host and port")
        try:
            reader = _Reader((url.hostname, url.port), deadline, name, self._tls)
        except NotTheJob as exc:
            raise HealRefused(f"the heal source at {name} is not one of the job's processes: "
                              f"{exc}") from None
        except OSError as exc:
            raise HealRefused(f"cannot reach the heal source {name}: {exc}") from exc
        with reader:
            reader.send(f"GET {url.path}?{url.query} HTTP/1.0\r\nHost: {url.netloc}\r\n\r\n")
            status, reason, headers = reader.head()
            if status != 200:
                raise HealRefused(f"{name} answered {status}: {reason}")
            for header, sent in ((_SOURCE, query.get("source", [""])[0]),
                                 (_NONCE, query.get("nonce", [""])[0])):
                if headers.get(header.lower()) != sent:
                    raise HealRefused(
                        f"{name} answered with {header} {headers.get(header.lower())!r}, not "
                        f"{sent!r}: not the answer of the source the quorum named to this "
                        f"request")
            length = headers.get("content-length", "")
            if not length.isdigit() or int(length) > self._max_bytes:
                raise HealRefused(
                    f"{name} sends {length or 'an unknown number of'} bytes; a heal is "
                    f"bounded by {self._max_bytes} (PIPELINE_MAX_MESSAGE_BYTES)")
            data = reader.body(int(length))
        try:
            with warnings.catch_warnings():
                # The loader wraps each tensor around the read-only bytes received (and warns
                # so); the clone below gives the optimizer state memory of its own.
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                state = _streaming_load(io.BytesIO(memoryview(data)), weights_only=True)
        except Exception as exc:  # weights_only refuses code; a torn file fails here too
            raise HealRefused(f"the checkpoint from {name} is not plain data: {exc}") from exc
        return tree_map_only(torch.Tensor, torch.Tensor.clone, state)

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving; with `wait` False (torchft's Manager.shutdown(wait=False)) without
        waiting for the serving loop, which ends within its poll interval. The socket is
        closed only once the loop has ended: closed under it, the loop's poll returned at
        once on the dead descriptor, and the thread spun on a core for the rest of the
        process."""

        def stop() -> None:
            self._server.shutdown()  # returns once serve_forever has
            self._server.server_close()

        if wait:
            stop()
            self._thread.join()
        else:
            threading.Thread(target=stop, daemon=True, name="heal-transport-stop").start()


class _Reader:
    """One HTTP exchange under the job's TLS whose every byte must arrive before one deadline:
    a peer sending a byte at a time is cut there, not at a timeout per read."""

    def __init__(self, address: tuple[str, int], deadline: float, name: str,
                 tls: JobTLS) -> None:
        self.deadline, self.name = deadline, name
        self.data = bytearray()
        self.sock: socket.socket = tls.client(
            socket.create_connection(address, timeout=self._left()), self._left())

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise HealRefused(f"{self.name} did not send its checkpoint within the heal's "
                              f"deadline ({len(self.data)} bytes read)")
        return left

    def send(self, text: str) -> None:
        self.sock.settimeout(self._left())
        self.sock.sendall(text.encode())

    def _more(self, limit: int) -> bool:
        """Read up to `limit` more bytes; False at the end of the stream."""
        try:
            self.sock.settimeout(self._left())
            chunk = self.sock.recv(min(limit, 1 << 20))
        except TimeoutError:
            self._left()  # raises: the deadline passed
            return True
        except OSError as exc:  # ssl.SSLError too: a byte changed on the way breaks it
            raise HealRefused(f"{self.name} broke off after {len(self.data)} bytes: "
                              f"{exc}") from exc
        self.data += chunk
        return bool(chunk)

    def head(self) -> tuple[int, str, dict[str, str]]:
        while b"\r\n\r\n" not in self.data:
            if len(self.data) > _HEAD_LIMIT:
                raise HealRefused(f"{self.name} sent over {_HEAD_LIMIT} bytes of headers")
            if not self._more(_HEAD_LIMIT):
                raise HealRefused(f"{self.name} closed before its answer's head")
        raw, _, rest = bytes(self.data).partition(b"\r\n\r\n")
        self.data = bytearray(rest)
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise HealRefused(f"{self.name} did not answer in HTTP ({lines[0][:80]!r})")
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        return int(parts[1]), parts[2] if len(parts) > 2 else "", headers

    def body(self, size: int) -> bytearray:
        while len(self.data) < size:
            if not self._more(size - len(self.data)):
                raise HealRefused(f"{self.name} closed after {len(self.data)} of {size} bytes")
        return self.data[:size]


class _Server(http.server.ThreadingHTTPServer):
    """Each connection under the job's TLS, its handshake in the connection's own thread (a
    silent client holds no other up)."""

    daemon_threads = True
    request_queue_size = 128
    tls: JobTLS

    def finish_request(self, request: Any, client_address: Any) -> None:
        try:
            conn = self.tls.server(request, _SAY_HELLO_S)
        except NotTheJob as exc:
            _log.warning("refused a checkpoint request from %s: not one of the job's "
                         "processes (%s)", client_address[0], exc)
            return
        try:
            self.RequestHandlerClass(conn, client_address, self)  # type: ignore[arg-type]
        except (OSError, ssl.SSLError):
            pass  # the peer went, or a byte changed on the way: nothing more to say to it
        finally:
            conn.close()


class _Server6(_Server):
    address_family = socket.AF_INET6


def _handler(transport: HealTransport) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = _SAY_HELLO_S  # per read of the request: a silent client is dropped

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            query = parse_qs(url.query)
            if len(parts) != 3 or parts[0] != "checkpoint" or not parts[1].isdigit() \
                    or not parts[1].isascii() or parts[2] != "full":
                self._refuse(400, f"only /checkpoint/<step>/full; got {url.path!r}")
                return
            refused = transport._check(query.get("nonce", [""])[0],
                                       query.get("source", [""])[0])
            if refused is not None:
                self._refuse(*refused)
                return
            try:
                payload = transport._serve(int(parts[1]))
            except HealRefused as exc:
                self._refuse(409, str(exc))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header(_SOURCE, transport.source)
            self.send_header(_NONCE, query["nonce"][0])
            self.end_headers()
            self.wfile.write(payload)

        def _refuse(self, status: int, why: str) -> None:
            # ascii(): a field's odd characters are shown escaped, never sent raw (the status
            # line is latin-1).
            why = ascii(why)[1:-1][:300]
            _log.warning("refused a checkpoint request from %s: %s", self.client_address[0],
                         why)
            self.send_error(status, why)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request on stderr otherwise; refusals are logged above

    return Handler


def check_same_model(mine: dict[str, Any], theirs: dict[str, Any],
                     local: Callable[[Any], torch.Tensor]) -> None:
    """Refuse a heal from a peer whose stage is another model: a configuration error (the
    launcher ends the job naming it), not a failure to restart and heal from again."""
    keys = sorted(set(mine) ^ set(theirs))
    shapes = sorted(k for k in set(mine) & set(theirs)
                    if isinstance(theirs[k], torch.Tensor)
                    and tuple(local(mine[k]).shape) != tuple(theirs[k].shape))
    if keys or shapes:
        what = (f"other keys ({keys[:5]})" if keys else
                f"other shapes ({shapes[0]}: {tuple(theirs[shapes[0]].shape)} there, "
                f"{tuple(local(mine[shapes[0]]).shape)} here)")
        raise PipeConfigError(
            f"the healing peer's stage state has {what} than this rank's: every replica "
            f"group must build the same model, split the same way")
