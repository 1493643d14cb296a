"""The measured cost of sending a tensor between two ranks: a latency and a time per byte."""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.transport import LocalTransport

__all__ = ["TRANSPORTS", "Link", "measure_link"]

TRANSPORTS = ("threads", "gloo", "nccl")
_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 23)  # bytes: 1 KiB .. 8 MiB


@dataclass(frozen=True, slots=True)
class Link:
    """One message of `n` bytes from a rank to another takes `latency + n * per_byte` seconds
    over `transport`. `Link.free()` is a link that costs nothing (for tests and what-ifs)."""

    transport: str
    latency: float
    per_byte: float

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} (got {self.transport!r})")
        if not (self.latency >= 0 and self.per_byte >= 0):
            raise ValueError(f"latency and per_byte must be >= 0 (got {self.latency}, "
                             f"{self.per_byte})")

    @classmethod
    def free(cls, transport: str = "threads") -> Link:
        return cls(transport, 0.0, 0.0)

    def time(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes` bytes."""
        return self.latency + nbytes * self.per_byte

    def allreduce(self, nbytes: float, ranks: int) -> float:
        """Seconds for a ring all-reduce of `nbytes` over `ranks` ranks, from this link: 2(n-1)
        steps, each sending 1/n of the data (derived from the point-to-point measurement)."""
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) * self.time(nbytes / ranks)


def _fit(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of seconds = latency + bytes * per_byte, both clamped at >= 0."""
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    var = sum((x - mx) ** 2 for x, _ in samples)
    slope = sum((x - mx) * (y - my) for x, y in samples) / var if var > 0 else 0.0
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def _threads(devices: Sequence[torch.device], sizes: Sequence[int],
             repeats: int) -> list[tuple[float, float]]:
    """Ping-pong between two threads through the in-process transport the Pipe uses."""
    transport = LocalTransport(timeout=60.0)
    out: list[tuple[float, float]] = []
    for size in sizes:
        payload = torch.zeros(size // 4, device=devices[0])
        rounds: list[float] = []

        def echo(n: int = repeats + 1) -> None:
            for i in range(n):
                (got,) = transport.wait(("F", 0, i), 0, devices[1])
                transport.send(("B", 0, i), (got,), 0)

        peer = threading.Thread(target=echo, daemon=True)
        peer.start()
        for i in range(repeats + 1):
            start = time.perf_counter()
            transport.send(("F", 0, i), (payload,), 1)
            (back,) = transport.wait(("B", 0, i), 1, devices[0])
            if back.is_cuda:
                torch.cuda.synchronize(back.device)
            if i:  # the first round warms up
                rounds.append((time.perf_counter() - start) / 2)
        peer.join()
        out.append((float(size), statistics.median(rounds)))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _process(rank: int, backend: str, port: int, sizes: Sequence[int], repeats: int,
             queue: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        out = []
        for size in sizes:
            payload = torch.zeros(size // 4, device=device)
            rounds = []
            for i in range(repeats + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                if rank == 0:
                    dist.send(payload, 1)
                    dist.recv(payload, 1)
                else:
                    dist.recv(payload, 0)
                    dist.send(payload, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:
                    rounds.append((time.perf_counter() - start) / 2)
            out.append((float(size), statistics.median(rounds)))
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def _processes(backend: str, sizes: Sequence[int], repeats: int) -> list[tuple[float, float]]:
    """Ping-pong between two fresh processes over `backend` on this machine (loopback)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_process, args=(r, backend, port, sizes, repeats, queue),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed or queue.empty():
        raise RuntimeError(f"measuring the {backend} link failed (process exit codes "
                           f"{[p.exitcode for p in procs]})")
    result: list[tuple[float, float]] = queue.get()
    return result


def measure_link(transport: str = "threads", *, devices: Sequence[str | torch.device] = ("cpu",
                 "cpu"), sizes: Sequence[int] = _SIZES, repeats: int = 20) -> Link:
    """Measure one-way message time between two ranks over `transport` ("threads": the
    in-process transport between `devices[0]` and `devices[1]`; "gloo" or "nccl": two local
    processes, on CPU or on GPUs 0 and 1) for each size in `sizes` (bytes; median of
    `repeats` round trips, halved) and fit `latency + bytes * per_byte`."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} (got {transport!r})")
    if len(sizes) < 2 or repeats < 1:
        raise ValueError(f"need at least two sizes and one repeat (got {list(sizes)}, "
                         f"{repeats})")
    if transport == "threads":
        pair = [torch.device(d) for d in devices]
        samples = _threads(pair if len(pair) > 1 else pair * 2, sizes, repeats)
    else:
        samples = _processes(transport, sizes, repeats)
    latency, per_byte = _fit(samples)
    return Link(transport, latency, per_byte)
