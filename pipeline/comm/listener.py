"""The listening end of same-host links: connections taken from the moment the socket exists.

A link's listening rank binds an abstract socket whose name every local user can see
(/proc/net/unix) and connect to. If connections were taken only once the rank knew its
callers (after reading the store, which waits for the peers), a stranger watching for new
names could fill the listen backlog first: the real caller's connect would fail with EAGAIN
and the pair would quietly fall back to the backend. So `Listener` takes connections in a
thread of its own from the start, with a backlog as large as the kernel allows: one of
another uid is closed at once (SO_PEERCRED, before a byte is read), a hello is checked against
the pair's secret as soon as it is whole, and what can be checked only against the store's
records (the caller's pid, whether it dialed) is checked once `expect` gives them. See
link_auth for the handshake itself.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
import uuid

from pipeline.comm import link_auth

__all__ = ["PROVE", "Listener"]

# Seconds a caller that announced its dial has, from then, to be accepted: it connected and
# sent its hello before announcing, so only a caller that lied (or a planted record) takes it.
PROVE = 10.0
# As large a backlog as the kernel allows (it caps it at net.core.somaxconn, 4096 on current
# kernels): a stranger must then open thousands of connections faster than the thread below
# closes them to make a caller's connect fail, and that caller retries until its deadline.
_BACKLOG = 1 << 16
_DRAIN = 1024  # connections taken per wake-up: the hellos of those taken are read meanwhile


class _Conn:
    """An accepted connection of our uid, its hello so far, and when it must be whole."""

    __slots__ = ("got", "hi", "nonce", "sock", "until")

    def __init__(self, sock: socket.socket, until: float) -> None:
        self.sock, self.until = sock, until
        self.got = bytearray()
        self.hi: int | None = None  # the caller's rank, once its hello proved the secret
        self.nonce = b""


class Listener:
    """Rank `lo`'s listening socket for its higher peers `secrets` (rank -> pair secret),
    taking connections in a thread until every expected caller has linked, `deadline`
    (monotonic) passes, or it is closed."""

    def __init__(self, lo: int, secrets: dict[int, bytes], deadline: float) -> None:
        self.lo, self._secrets, self._deadline = lo, dict(secrets), deadline
        self.name = f"pipeline-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            self._sock.bind("\0" + self.name)  # abstract: see same_host
            self._sock.listen(_BACKLOG)
            self._sock.setblocking(False)
        except BaseException:
            self._close_sockets()
            raise
        self._lock = threading.Lock()
        self._expected: dict[int, int] | None = None  # caller rank -> announced pid
        self._until = deadline  # becomes sooner once the callers are known
        self._stop = False
        self._linked: dict[int, socket.socket] = {}
        self._refused: dict[int, str] = {}  # caller rank -> why its connection was refused
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="pipeline-link-listener")
        self._thread.start()

    def expect(self, callers: dict[int, int]) -> None:
        """The callers that announced their dial to this rank (rank -> announced pid): each
        has `PROVE` seconds more to link."""
        with self._lock:
            self._expected = {hi: pid for hi, pid in callers.items() if hi in self._secrets}
            self._until = min(self._deadline, time.monotonic() + PROVE)
        self._wake()

    def result(self) -> tuple[dict[int, socket.socket], dict[int, str]]:
        """After `expect`: wait for the thread; the linked callers' connections (answered)
        and, per expected caller that did not link, why."""
        self._thread.join()
        with self._lock:
            expected = self._expected or {}
        missing = {hi: self._refused.get(hi, f"rank {hi} announced its dial but no "
                                             f"connection of it proved itself in time")
                   for hi in expected if hi not in self._linked}
        linked, self._linked = self._linked, {}  # handed out: close() leaves them open
        return linked, missing

    def close(self) -> None:
        """Stop taking connections; connections not handed out by `result` are closed."""
        self._stop = True
        self._wake()
        self._thread.join()
        for sock in self._linked.values():
            sock.close()
        self._linked = {}
        self._close_sockets()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _close_sockets(self) -> None:
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        pending: dict[int, _Conn] = {}  # fd -> connection of our uid not linked yet
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        poller.register(self._wake_r.fileno(), select.POLLIN)
        try:
            while not self._stop:
                now = time.monotonic()
                with self._lock:
                    expected, until = self._expected, self._until
                if expected is not None:
                    self._link_proved(pending, poller, expected)
                    if all(hi in self._linked for hi in expected):
                        return
                if now >= until:
                    return
                for fd, conn in list(pending.items()):
                    if conn.hi is None and now >= conn.until:  # no whole hello in time
                        self._drop(pending, poller, fd)
                wait = min([until, *(c.until for c in pending.values() if c.hi is None)])
                for fd, _ in poller.poll(max(0.0, wait - now) * 1000):
                    if fd == self._sock.fileno():
                        self._take(pending, poller)
                    elif fd == self._wake_r.fileno():
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    elif fd in pending:
                        self._read(pending, poller, fd)
        finally:
            for fd in list(pending):
                self._drop(pending, poller, fd)

    def _take(self, pending: dict[int, _Conn], poller: select.poll) -> None:
        """The connections waiting in the backlog, up to `_DRAIN`: a flood is drained in bulk,
        not one per poll."""
        for _ in range(_DRAIN):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, say: the backlog keeps the rest
                return
            try:
                link_auth.check_peer(sock, None)  # another uid: refused before it is read
            except (link_auth.Refused, OSError):
                sock.close()
                continue
            sock.setblocking(False)
            pending[sock.fileno()] = _Conn(sock, time.monotonic() + link_auth.HANDSHAKE)
            poller.register(sock.fileno(), select.POLLIN)

    def _read(self, pending: dict[int, _Conn], poller: select.poll, fd: int) -> None:
        conn = pending[fd]
        if conn.hi is not None:  # proved, waiting for `expect`: anything more is wrong
            self._drop(pending, poller, fd)
            return
        try:
            chunk = conn.sock.recv(link_auth.HELLO - len(conn.got))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(pending, poller, fd)
            return
        conn.got += chunk
        if len(conn.got) < link_auth.HELLO:
            return
        try:
            conn.hi, conn.nonce = link_auth.check_mac(bytes(conn.got), self._secrets, self.lo)
        except link_auth.Refused:
            self._drop(pending, poller, fd)
        # Proved: it waits for `expect`, still watched (a close or more bytes drop it).

    def _link_proved(self, pending: dict[int, _Conn], poller: select.poll,
                     expected: dict[int, int]) -> None:
        """Answer and link each proved connection whose caller is expected, from its
        announced pid; drop the rest of the proved ones."""
        for fd, conn in list(pending.items()):
            hi = conn.hi
            if hi is None:
                continue
            try:
                if hi not in expected:
                    raise link_auth.Refused(f"rank {hi} did not announce a dial to this rank")
                if hi in self._linked:
                    raise link_auth.Refused(f"rank {hi} is linked already")
                link_auth.check_peer(conn.sock, expected[hi])
                conn.sock.setblocking(True)
                conn.sock.settimeout(link_auth.HANDSHAKE)
                conn.sock.sendall(link_auth.answer(self._secrets[hi], self.lo, hi, conn.nonce))
            except (link_auth.Refused, OSError) as exc:
                if hi in expected:
                    self._refused[hi] = f"a connection claiming rank {hi} was refused: {exc}"
                self._drop(pending, poller, fd)
                continue
            poller.unregister(fd)
            del pending[fd]
            self._linked[hi] = conn.sock
            self._refused.pop(hi, None)

    @staticmethod
    def _drop(pending: dict[int, _Conn], poller: select.poll, fd: int) -> None:
        conn = pending.pop(fd)
        with contextlib.suppress(KeyError, OSError):
            poller.unregister(fd)
        conn.sock.close()
