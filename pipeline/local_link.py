"""Same-host links: ordered bytes between two process ranks of one machine over a Unix socket.

gloo moves every point-to-point message through a rendezvous (the receiver announces its
buffer, the sender announces its data, then the data moves) and through an I/O thread that
wakes the waiting one: on loopback a 1 KiB round trip costs several hundred microseconds. When
two ranks share a host, a connected Unix stream socket does the same job with one write and
one read: the sender writes from its own thread (a writer thread takes over only a message the
socket cannot take at once, so a send never blocks), and the receiver reads straight into its
buffer from the thread that needs the data, waking the moment the bytes arrive. Between
messages the waits check for failures every `WAKE` seconds, never per message.

`connect` sets the links up through the rendezvous store, and agrees with each peer whether
its link works (containers that share a host name but not a network namespace fall back to
gloo, as do other platforms and `PIPELINE_LOCAL_P2P=0`).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ENV", "WAKE", "LinkBroken", "SocketLink", "connect", "host_key"]

ENV = "PIPELINE_LOCAL_P2P"  # "0": same-host ranks talk over the process group's backend too
WAKE = 0.05  # seconds between failure checks while a wait has nothing to read or write
# Per (group, rank): links set up so far, the same count on every rank of a group.
_instances: dict[tuple[str, int], int] = {}


class LinkBroken(ConnectionError):
    """The peer closed its end (its process died) or the socket failed."""


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, as bytes (shared, not copied)."""
    return tensor.numpy().data.cast("B")


class _Send:
    """One send: done once every byte is in the socket (`tensor` lives until then)."""

    __slots__ = ("done", "error", "event", "sent", "tensor", "view")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.view = _bytes(tensor)
        self.sent = 0
        self.done = False
        self.error: BaseException | None = None
        self.event: threading.Event | None = None  # only for sends the writer thread finishes

    def wait(self, deadline: float, tick: Callable[[float], None] | None = None) -> None:
        """Until the last byte is written: raise TimeoutError after `deadline` (monotonic),
        and call `tick(now)` every WAKE seconds if given (it raises to give up)."""
        while not self.done:
            assert self.event is not None
            if self.error is None:
                self.event.wait(WAKE)
            if self.error is not None:
                raise LinkBroken(str(self.error))
            now = time.monotonic()
            if tick is not None:
                tick(now)
            if now > deadline and not self.done:
                raise TimeoutError


class SocketLink:
    """A connected Unix stream socket to one peer: ordered messages both ways.

    Sends are written in the caller's thread when the socket takes them whole (the usual case:
    the kernel buffers a message until the peer reads it); what it cannot take waits, in
    order, for the link's writer thread. Receives read in the caller's thread.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._readable = select.poll()
        self._readable.register(sock.fileno(), select.POLLIN)
        self._lock = threading.Condition()
        self._queue: deque[_Send] = deque()  # sends not yet written whole, oldest first
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False

    def send(self, tensor: torch.Tensor) -> _Send:
        """Start sending `tensor`'s bytes (contiguous, on the CPU); never blocks."""
        item = _Send(tensor)
        with self._lock:
            if self._error is not None:
                raise LinkBroken(str(self._error))
            if not self._queue:  # nothing ahead of it: write now
                try:
                    item.sent = self._sock.send(item.view)
                except BlockingIOError:  # the socket is full: the writer takes it all
                    pass
                except OSError as exc:
                    self._error = exc
                    raise LinkBroken(str(exc)) from exc
                if item.sent == len(item.view):
                    item.done = True
                    return item
            item.event = threading.Event()
            self._queue.append(item)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                name="pipeline-link-writer")
                self._writer.start()
            self._lock.notify()
        return item

    def _write_loop(self) -> None:
        writable = select.poll()
        writable.register(self._sock.fileno(), select.POLLOUT)
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                item = self._queue[0]
            writable.poll(WAKE * 1000)
            try:
                item.sent += self._sock.send(item.view[item.sent:])
            except BlockingIOError:
                continue
            except OSError as exc:
                with self._lock:
                    self._error = exc
                    for waiting in self._queue:
                        waiting.error = exc
                        assert waiting.event is not None
                        waiting.event.set()
                    self._queue.clear()
                return
            if item.sent == len(item.view):
                with self._lock:
                    self._queue.popleft()
                item.done = True
                assert item.event is not None
                item.event.set()
            del item  # hold no finished tensor while idle

    def recv_into(self, tensor: torch.Tensor, deadline: float,
                  tick: Callable[[float], None] | None = None) -> None:
        """Fill `tensor` (contiguous, on the CPU) with the next bytes from the peer, waking as
        they arrive. Raises LinkBroken when the peer is gone, TimeoutError after `deadline`
        (monotonic); `tick(now)`, if given, runs between reads (it raises to give up)."""
        view = _bytes(tensor)
        got, size = 0, len(view)
        while got < size:
            try:
                n = self._sock.recv_into(view[got:])
            except BlockingIOError:
                self._readable.poll(WAKE * 1000)
                now = time.monotonic()
                if tick is not None:
                    tick(now)
                if now > deadline:
                    raise TimeoutError from None
                continue
            except OSError as exc:
                raise LinkBroken(str(exc)) from exc
            if n == 0:
                raise LinkBroken("the peer closed the connection")
            got += n

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        with contextlib.suppress(OSError):
            self._sock.close()


def host_key() -> str:
    """What two processes on one machine (booted once) share and others do not."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


def connect(store: Any, ranks: list[int], me: int, timeout: float) -> dict[int, SocketLink]:
    """Links from rank `me` to every peer of `ranks` (global ranks, indexed by group rank) on
    this host, by group rank. Every rank of the group calls it (transport construction is
    collective); each pair agrees through `store` whether its link works."""
    if (os.environ.get(ENV, "1") == "0" or store is None or len(ranks) < 2
            or not sys.platform.startswith("linux")):
        return {}
    group = "-".join(map(str, ranks))
    _instances[group, me] = number = _instances.get((group, me), 0) + 1
    prefix = f"pipeline/link/{group}/{number}/"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"pipeline-{uuid.uuid4().hex}"
    listener.bind("\0" + name)  # the abstract namespace: no file to clean up
    listener.listen(len(ranks))
    here = host_key()
    store.set(f"{prefix}host/{me}", f"{here}\n{name}")
    peers: dict[int, str] = {}  # same-host peer -> its socket's name
    for peer in range(len(ranks)):
        if peer != me:
            host, _, address = store.get(f"{prefix}host/{peer}").decode().partition("\n")
            if host == here:
                peers[peer] = address
    socks: dict[int, socket.socket] = {}
    for peer in (p for p in peers if p < me):  # the higher rank of a pair dials
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect("\0" + peers[peer])
            sock.sendall(struct.pack("<q", me))
            socks[peer] = sock
        except OSError:
            sock.close()
    store.set(f"{prefix}dialed/{me}", ",".join(map(str, socks)))
    callers = [p for p in peers if p > me
               and str(me) in store.get(f"{prefix}dialed/{p}").decode().split(",")]
    listener.settimeout(timeout)
    try:
        for _ in callers:  # they are in the backlog already
            conn, _ = listener.accept()
            conn.settimeout(timeout)
            (peer,) = struct.unpack("<q", _read(conn, 8))
            socks[peer] = conn
    except OSError:  # a caller that never arrives keeps the backend: see the agreement below
        pass
    finally:
        listener.close()
    store.set(f"{prefix}linked/{me}", ",".join(map(str, socks)))
    links = {}
    for peer, sock in socks.items():
        if str(me) in store.get(f"{prefix}linked/{peer}").decode().split(","):
            links[peer] = SocketLink(sock)
        else:
            sock.close()
    return links


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data
