"""Fixtures of the replica job tests: the job's certificate, and a relay between two ends."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from pipeline.replicas import tls as ft_tls

JOB_PEM = ft_tls.make_job_cert()  # one job's certificate and key, for this test session


@pytest.fixture
def job_cert(monkeypatch: pytest.MonkeyPatch) -> ft_tls.JobTLS:
    """This process (and the processes it starts) holds the job's certificate."""
    monkeypatch.setenv(ft_tls.CERT_ENV, JOB_PEM)
    return ft_tls.job_tls()


class Relay:
    """A TCP relay on loopback to `port`: every byte it forwards is kept in `seen` (those
    from the clients in `up` too), and with
    `flip` set to "up" (client to server) or "down" it changes one bit of the next chunk
    that way, as a machine in the middle would; with `flip_at` set to (way, n), the byte at
    offset n of a connection's stream that way. `streams` holds each connection's bytes each
    way, counted."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.seen = bytearray()
        self.up = bytearray()  # what the clients sent, alone
        self.flip: str | None = None
        self.flip_at: tuple[str, int] | None = None
        self.streams: list[dict[str, int]] = []
        self.forwarded = threading.Event()  # set once a changed chunk went on
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._socks: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [client, server]
            counts = {"up": 0, "down": 0}
            self.streams.append(counts)
            for src, dst, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pipe, args=(src, dst, way, counts),
                                 daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, way: str,
              counts: dict[str, int]) -> None:
        try:
            while chunk := src.recv(1 << 16):
                at = self.flip_at[1] - counts[way] if self.flip_at is not None else -1
                if self.flip == way or (self.flip_at and self.flip_at[0] == way
                                        and 0 <= at < len(chunk)):
                    at = at if self.flip != way else len(chunk) - 1
                    self.flip, self.flip_at = None, None
                    chunk = chunk[:at] + bytes([chunk[at] ^ 1]) + chunk[at + 1:]
                    self.forwarded.set()
                counts[way] += len(chunk)
                self.seen += chunk
                if way == "up":
                    self.up += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def relay() -> Iterator[type[Relay]]:
    """Relays to make (each closed at the test's end)."""
    made: list[Relay] = []

    class Made(Relay):
        def __init__(self, port: int) -> None:
            super().__init__(port)
            made.append(self)

    yield Made
    for r in made:
        r.close()
