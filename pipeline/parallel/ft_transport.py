"""The heal transport: a peer's checkpoint over HTTP, both ends proving the job's secret.

torchft's HTTPTransport binds every interface, serves `/checkpoint/<step>/full` to anyone,
unpickles what it fetches with `weights_only=False`, and reads it with a timeout per socket
operation only (a peer sending a byte a second was still being read after 30 s of a 3 s
timeout). This one, in its place (`checkpoint_transport=` of torchft's Manager):

    healing rank -> source   GET /checkpoint/<step>/full?nonce=N&proof=HMAC(k, fetch, step, N)
    source -> healing rank   200, Content-Length: n + 32,
                             X-Pipeline-Proof: HMAC(k, head, step, N, n);
                             the checkpoint (n bytes, torch's streaming format),
                             then HMAC(k, body, step, N) over it

The source serves only a request proving the secret (else 403, logged); the healing rank
refuses an answer whose head does not prove it before reading the body, refuses a body over
the size bound, reads the whole answer within one deadline, checks the trailing MAC before
deserializing anything, loads with `weights_only=True`, and refuses a checkpoint whose step is
not the quorum's. A refusal raises `HealRefused`: torchft's Manager records it (report_error),
applies nothing and commits no step. With no secret (`PIPELINE_FT_SECRET` unset) nothing is
proved and the answer is the bare checkpoint, as torchft's own, deadline and bound kept.
"""

from __future__ import annotations

import hmac
import http.server
import io
import logging
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch
from torch.distributed._serialization import _streaming_load, _streaming_save
from torch.utils._pytree import tree_map_only
from torchft.checkpointing import CheckpointTransport

from pipeline.errors import PipeConfigError, PipelineError
from pipeline.parallel.ft_auth import bind_host, host_port, job_secret, signer

__all__ = ["HealRefused", "SignedTransport", "check_same_model"]

_log = logging.getLogger(__name__)

_MAC = 32  # bytes of an HMAC-SHA256
_HEAD_LIMIT = 64 * 1024  # bytes of an answer's status line and headers
_PROOF = "X-Pipeline-Proof"
_SAY_HELLO_S = 5.0  # a request's line and headers arrive within this, or the server moves on


class HealRefused(PipelineError):
    """A heal's source or answer that the job does not accept (not its secret, too slow, too
    large, another step)."""


class SignedTransport(CheckpointTransport[dict[str, Any]]):  # type: ignore[misc]
    """torchft's checkpoint transport (send_checkpoint, recv_checkpoint, metadata), its HTTP
    server bound to `host` and both ends proving `secret`."""

    def __init__(self, timeout: timedelta, *, secret: bytes | None = None,
                 host: str | None = None, max_bytes: int | None = None) -> None:
        from pipeline.comm import wire

        self._secret = job_secret() if secret is None else secret
        self._timeout = timeout
        # A heal is a message from a peer: the same bound (the machine's memory, or
        # PIPELINE_MAX_MESSAGE_BYTES).
        self._max_bytes = (wire.message_limit(os.environ.get(wire.LIMIT_ENV))
                           if max_bytes is None else max_bytes)
        self._ready = threading.Condition()
        self._step = -1
        self._payload: bytes | None = None  # the checkpoint served, saved once per step
        host = bind_host() if host is None else host
        server_class = _Server6 if ":" in host else _Server
        self._server = server_class((host, 0), _handler(self))
        self._address = f"http://{host_port(host, self._server.server_address[1])}/checkpoint/"
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

    def _serve(self, step: int, nonce: str, proof: str) -> tuple[bytes, bytes, str] | None:
        """(checkpoint, trailing MAC, head proof) for a request proving the secret, once the
        checkpoint of `step` is ready (waiting up to the timeout); None when refused."""
        want = signer(self._secret, "fetch", step, nonce).hexdigest()
        if self._secret is not None and not hmac.compare_digest(proof, want):
            return None
        with self._ready:
            self._ready.wait_for(lambda: self._step == step,
                                 timeout=self._timeout.total_seconds())
            payload = self._payload if self._step == step else None
        if payload is None:
            raise HealRefused(f"no checkpoint of step {step} to serve within "
                              f"{self._timeout.total_seconds():g}s (serving {self._step})")
        if self._secret is None:
            return payload, b"", ""
        body = signer(self._secret, "body", step, nonce)
        body.update(payload)
        head = signer(self._secret, "head", step, nonce, len(payload)).hexdigest()
        return payload, body.digest(), head

    # -- the healing rank's side ---------------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> dict[str, Any]:
        nonce = secrets.token_hex(16)
        proof = signer(self._secret, "fetch", step, nonce).hexdigest()
        state = self._load_from_address(f"{metadata}{step}/full?nonce={nonce}&proof={proof}",
                                        timeout)
        own = state.get("torchft") if isinstance(state, dict) else None
        held = own.get("step") if isinstance(own, dict) else None
        if held != step:
            raise HealRefused(f"the heal source at {metadata!r} holds step {held!r}, not the "
                              f"quorum's step {step}: not applied")
        return state  # type: ignore[no-any-return]

    def _load_from_address(self, address: str, timeout: timedelta) -> Any:
        """The checkpoint at `address` (a URL naming its step and nonce), read in full within
        `timeout`, checked, then loaded as plain data. Raises HealRefused (logged)."""
        try:
            return self._load(address, time.monotonic() + timeout.total_seconds())
        except HealRefused as exc:
            _log.warning("heal refused, nothing applied: %s", exc)
            raise

    def _load(self, address: str, deadline: float) -> Any:
        url = urlsplit(address)
        query = parse_qs(url.query)
        step, nonce = url.path.rstrip("/").split("/")[-2], query.get("nonce", [""])[0]
        if url.scheme != "http" or url.hostname is None or url.port is None:
            raise HealRefused(f"the heal source's address {address!r} is not http://host:port")
        try:
            reader = _Reader((url.hostname, url.port), deadline, address)
        except OSError as exc:
            raise HealRefused(f"cannot reach the heal source {address.split('?')[0]}: "
                              f"{exc}") from exc
        with reader:
            target = (url.path or "/") + (f"?{url.query}" if url.query else "")
            reader.send(f"GET {target} HTTP/1.0\r\nHost: {url.netloc}\r\n\r\n")
            status, headers = reader.head()
            if status != 200:
                raise HealRefused(f"{address.split('?')[0]} answered {status}")
            mac_size = _MAC if self._secret is not None else 0
            # No length: read to the end (torchft's own server, in a job without a secret).
            length = headers.get("content-length", "" if mac_size else str(self._max_bytes))
            if not length.isdigit() or not mac_size <= int(length) <= self._max_bytes + mac_size:
                raise HealRefused(
                    f"{address.split('?')[0]} sends {length or 'an unknown number of'} bytes; "
                    f"a heal is bounded by {self._max_bytes} (PIPELINE_MAX_MESSAGE_BYTES)")
            if self._secret is not None:
                head = signer(self._secret, "head", step, nonce, int(length) - _MAC)
                if not hmac.compare_digest(headers.get(_PROOF.lower(), ""), head.hexdigest()):
                    raise HealRefused(f"{address.split('?')[0]} does not prove the job's "
                                      f"secret: it is not one of the job's ranks")
            data = reader.body(int(length), to_end="content-length" not in headers)
        size = len(data) - mac_size
        payload = memoryview(data)[:size]
        if self._secret is not None:
            body = signer(self._secret, "body", step, nonce)
            body.update(payload)
            if not hmac.compare_digest(body.digest(), bytes(data[size:])):
                raise HealRefused(f"the checkpoint from {address.split('?')[0]} is not the one "
                                  f"its source signed (altered, or forged)")
        try:
            with warnings.catch_warnings():
                # The loader wraps each tensor around the read-only bytes received (and warns
                # so); the clone below gives the optimizer state memory of its own.
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                state = _streaming_load(io.BytesIO(payload), weights_only=True)
        except Exception as exc:  # weights_only refuses code; a torn file fails here too
            raise HealRefused(f"the checkpoint from {address.split('?')[0]} is not plain "
                              f"data: {exc}") from exc
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
    """One HTTP exchange whose every byte must arrive before one deadline: a peer sending a
    byte at a time is cut there, not at a timeout per read."""

    def __init__(self, address: tuple[str, int], deadline: float, name: str) -> None:
        self.deadline, self.name = deadline, name.split("?")[0]
        self.data = bytearray()
        self.sock = socket.create_connection(address, timeout=self._left())

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
        except OSError as exc:
            raise HealRefused(f"{self.name} broke off after {len(self.data)} bytes: "
                              f"{exc}") from exc
        self.data += chunk
        return bool(chunk)

    def head(self) -> tuple[int, dict[str, str]]:
        while b"\r\n\r\n" not in self.data:
            if len(self.data) > _HEAD_LIMIT:
                raise HealRefused(f"{self.name} sent over {_HEAD_LIMIT} bytes of headers")
            if not self._more(_HEAD_LIMIT):
                raise HealRefused(f"{self.name} closed before its answer's head")
        raw, _, rest = bytes(self.data).partition(b"\r\n\r\n")
        self.data = bytearray(rest)
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise HealRefused(f"{self.name} did not answer in HTTP ({lines[0][:80]!r})")
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        return int(parts[1]), headers

    def body(self, size: int, *, to_end: bool = False) -> bytearray:
        """`size` bytes (with `to_end`: at most `size`, up to the end of the stream)."""
        while len(self.data) < size:
            if not self._more(size - len(self.data)):
                if to_end:
                    break
                raise HealRefused(f"{self.name} closed after {len(self.data)} of {size} bytes")
        if to_end and len(self.data) >= size and self._more(1):
            raise HealRefused(f"{self.name} sends over {size} bytes, the heal's bound")
        return self.data[:size]


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


class _Server6(_Server):
    address_family = socket.AF_INET6


def _handler(transport: SignedTransport) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = _SAY_HELLO_S  # per read of the request: a silent client is dropped

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            query = parse_qs(url.query)
            if len(parts) != 3 or parts[0] != "checkpoint" or not parts[1].isdigit() \
                    or parts[2] != "full":
                self.send_error(404, "only /checkpoint/<step>/full")
                return
            try:
                served = transport._serve(int(parts[1]), query.get("nonce", [""])[0],
                                          query.get("proof", [""])[0])
            except HealRefused as exc:
                self.send_error(409, str(exc))
                return
            if served is None:
                _log.warning("refused a checkpoint request from %s: it does not prove the "
                             "job's secret", self.client_address[0])
                self.send_error(403, "not one of the job's ranks")
                return
            payload, mac, head = served
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(payload) + len(mac)))
            if head:
                self.send_header(_PROOF, head)
            self.end_headers()
            self.wfile.write(payload)
            self.wfile.write(mac)

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
