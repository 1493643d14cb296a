"""A same-host link: ordered bytes between two process ranks of one machine over a Unix socket.

gloo moves every point-to-point message through a rendezvous (the receiver announces its
buffer, the sender announces its data, then the data moves) and through an I/O thread that
wakes the waiting one: on loopback a 1 KiB round trip costs several hundred microseconds. When
two ranks share a host, a connected Unix stream socket does the same job with one write and
one read: the sender writes from its own thread (a writer thread takes over only a message the
socket cannot take at once, so a send never blocks), and the receiver reads straight into its
buffer from the thread that needs the data, waking the moment the bytes arrive. Between
messages the waits check for failures every `WAKE` seconds, never per message. How two ranks
get such a socket, and who may use it: same_host.py.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from pipeline import settings
from pipeline.comm.transport import Broken

__all__ = ["SEND_BUFFER", "SPIN", "SPIN_ENV", "WAKE", "LinkBroken", "LinkSend", "SocketLink",
           "spin_setting", "spin_time"]

SPIN_ENV = "PIPELINE_SPIN_US"  # microseconds a receive polls before it sleeps (0: never)
# The default, when this host has a CPU for each of the job's processes: long enough to cover
# a peer's forward or backward of a few milliseconds (a wait that ends asleep pays the wake-up
# on the message that ends it), short enough that a bubble or a stalled peer holds no core.
SPIN = 5e-3
WAKE = 0.05  # seconds between failure checks while a wait has nothing to read or write
# Bytes of unread messages a link's socket may hold (SO_SNDBUF). Linux's default (about
# 208 KiB, counted with the kernel's bookkeeping) takes three 64 KiB activations whole; the
# fourth sent before the peer reads went to the writer thread. A schedule whose sender runs
# ahead (1F1B's first ranks, GPipe) leaves that many unread. A limit, not an allocation: the
# kernel holds only what is unread, which the sender would otherwise keep for the writer.
# Linux caps it at net.core.wmem_max (often the default itself: raise that to benefit).
SEND_BUFFER = 4 << 20


class LinkBroken(Broken):
    """The peer closed its end (its process died) or the socket failed."""


class LinkSend:
    """One message being written: done once every byte is in the socket. It holds `keep` (the
    objects owning the buffers' memory) until then. A `transport.Pending`."""

    __slots__ = ("done_", "error", "event", "keep", "parts")

    def __init__(self, parts: list[memoryview], keep: object) -> None:
        self.parts = parts  # what is left to write
        self.keep = keep
        self.done_ = False
        self.error: BaseException | None = None
        self.event: threading.Event | None = None  # only for sends the writer thread finishes

    def done(self) -> bool:
        return self.done_

    def advance(self, sent: int) -> bool:
        """Drop the first `sent` bytes from what is left; whether all is written."""
        parts = self.parts
        while parts and sent >= len(parts[0]):
            sent -= len(parts.pop(0))
        if sent:
            parts[0] = parts[0][sent:]
        if not parts:
            self.done_, self.keep = True, None
        return self.done_

    def wait(self, deadline: float, tick: Callable[[float], None] | None = None) -> None:
        """Until the last byte is written: raise TimeoutError after `deadline` (monotonic),
        and call `tick(now)` after each WAKE seconds without progress, if given (it raises to
        give up)."""
        while not self.done_:
            assert self.event is not None
            woke = self.error is not None or self.event.wait(WAKE)
            if self.error is not None:
                raise LinkBroken(str(self.error))
            if woke:  # written: no failure check (a store read) on the way out
                continue
            now = time.monotonic()
            if tick is not None:
                tick(now)
            if now > deadline and not self.done_:
                raise TimeoutError


class SocketLink:
    """A connected Unix stream socket to one peer: ordered messages both ways.

    A message is a list of buffers written with one `sendmsg` (scatter-gather: a header and
    tensors' own memory, never packed into one) in the caller's thread when the socket takes
    it whole (the usual case: the kernel buffers a message until the peer reads it); what it
    cannot take waits, in order, for the link's writer thread. Receives read straight into the
    caller's buffers (`recvmsg_into`), in the caller's thread.
    """

    def __init__(self, sock: socket.socket, spin: float = 0.0) -> None:
        sock.setblocking(False)
        # A stream message is charged to its sender's buffer only (SO_RCVBUF plays no part
        # in a Unix stream socket): each end sizes its own, for what it sends.
        with contextlib.suppress(OSError):  # a socket that refuses keeps the default
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self._sock = sock
        self.spin = spin  # seconds a receive retries before it sleeps (see spin_time)
        self._readable = select.poll()
        self._readable.register(sock.fileno(), select.POLLIN)
        self._lock = threading.Condition()
        self._queue: deque[LinkSend] = deque()  # sends not yet written whole, oldest first
        self._last: LinkSend | None = None  # the latest send the writer thread finishes
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False

    def send(self, parts: list[memoryview], keep: object = None) -> LinkSend:
        """Start sending the bytes of `parts`, in order, as one message; never blocks. `keep`
        owns their memory and is held until they are written (the caller must not change
        it meanwhile)."""
        item = LinkSend(parts, keep)
        with self._lock:
            if self._error is not None:
                raise LinkBroken(str(self._error))
            if not self._queue:  # nothing ahead of it: write now
                try:
                    if item.advance(self._sock.sendmsg(parts)):
                        return item
                except BlockingIOError:  # the socket is full: the writer takes it all
                    pass
                except OSError as exc:
                    self._error = exc
                    raise LinkBroken(str(exc)) from exc
            item.event = threading.Event()
            self._queue.append(item)
            self._last = item
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                name="pipeline-link-writer")
                self._writer.start()
            self._lock.notify()
        return item

    def flushed(self) -> LinkSend | None:
        """The last send still being written (when it is done, every earlier one is), or None
        when every send is in the socket."""
        last = self._last
        return None if last is None or last.done_ else last

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
                sent = self._sock.sendmsg(item.parts)
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
            if item.advance(sent):
                with self._lock:
                    self._queue.popleft()
                assert item.event is not None
                item.event.set()
            del item  # hold no finished buffers while idle

    def recv_into(self, parts: list[memoryview], deadline: float,
                  tick: Callable[[float], None] | None = None) -> None:
        """Fill the buffers of `parts`, in order, with the next bytes from the peer, waking as
        they arrive. Raises LinkBroken when the peer is gone, TimeoutError after `deadline`
        (monotonic); `tick(now)`, if given, runs each time a wait of WAKE brought nothing (it
        raises to give up), never on the way of bytes that came."""
        parts = [p for p in parts if len(p)]
        spin_until = None
        while parts:
            try:
                n = self._sock.recvmsg_into(parts)[0]
            except BlockingIOError:
                if self.spin:  # retry a while before sleeping: see spin_time
                    now = time.perf_counter()
                    if spin_until is None:
                        spin_until = now + self.spin
                    if now < spin_until:
                        continue
                if self._readable.poll(WAKE * 1000):
                    continue  # the bytes (or the peer's end) came: read, check nothing
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
            while parts and n >= len(parts[0]):
                n -= len(parts.pop(0))
            if n:
                parts[0] = parts[0][n:]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        with contextlib.suppress(OSError):
            self._sock.close()


def spin_setting() -> float | None:
    """`PIPELINE_SPIN_US` in seconds, checked, or None when it is not set."""
    value = settings.number(SPIN_ENV, default=None, low=0, high=999_999,
                            unit=" microseconds (0 turns spinning off)")
    return None if value is None else value * 1e-6


def spin_time(processes: int, setting: float | None) -> float:
    """Seconds a receive over a link retries before it sleeps in `poll`, with `processes` of
    the job on this host and `setting` from `spin_setting()`.

    Waking a process that sleeps in `poll` costs tens of microseconds (more in a virtual
    machine), which is most of a small message's cost; a receive that keeps trying sees the
    bytes within a microsecond or two. That is worth a core only while every process of the
    job has one: spinning on a shared core would take it from the peer that has to send. So
    by default a receive spins for `SPIN` when this process may use at least as many CPUs as
    the job has processes on this host, and never otherwise; `PIPELINE_SPIN_US` sets the time
    (microseconds; 0 turns spinning off)."""
    if setting is not None:
        return setting
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)
    return SPIN if processes <= cpus else 0.0
