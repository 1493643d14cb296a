"""The measured cost of moving tensors between ranks: a message's latency and time per byte.

Measured from messages between two ranks (`measure_link`) or from an all-reduce over several
(`measure_allreduce`)."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.comm.same_host import SocketLink, connect
from pipeline.comm.threads import ThreadTransport
from pipeline.comm.wire import memory

__all__ = ["TRANSPORTS", "Link", "measure_allreduce", "measure_link", "ring_fit"]

TRANSPORTS = ("threads", "gloo", "nccl")
_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 23)  # bytes: 1 KiB .. 8 MiB


@dataclass(frozen=True, slots=True)
class Link:
    """One message of `n` bytes from a rank to another takes `latency + n * per_byte` seconds
    over `transport`. `Link.free()` is a link that costs nothing (for tests and what-ifs)."""

    transport: str
    latency: float
    per_byte: float
    # The process group's own send and receive, where a pipeline's messages take another way
    # (same-host links): collectives (the dp all-reduce) still go through the group. None:
    # the same as `latency` and `per_byte`.
    collective_latency: float | None = None
    collective_per_byte: float | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} (got {self.transport!r})")
        for name in ("latency", "per_byte", "collective_latency", "collective_per_byte"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0 (got {value})")

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
        latency = self.latency if self.collective_latency is None else self.collective_latency
        per_byte = (self.per_byte if self.collective_per_byte is None
                    else self.collective_per_byte)
        return 2 * (ranks - 1) * (latency + nbytes / ranks * per_byte)


def _fit(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """seconds = latency + bytes * per_byte, fitted by relative error (each sample weighted by
    1 / seconds^2, so that 1 KiB counts as much as 8 MiB and the latency is not lost in the
    large sizes' noise); both clamped at >= 0."""
    weights = [1.0 / y ** 2 if y > 0 else 0.0 for _, y in samples]
    total = sum(weights)
    if total == 0:
        return 0.0, 0.0
    mx = sum(w * x for w, (x, _) in zip(weights, samples, strict=True)) / total
    my = sum(w * y for w, (_, y) in zip(weights, samples, strict=True)) / total
    var = sum(w * (x - mx) ** 2 for w, (x, _) in zip(weights, samples, strict=True))
    slope = (sum(w * (x - mx) * (y - my) for w, (x, y) in zip(weights, samples, strict=True))
             / var if var > 0 else 0.0)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def _threads(devices: Sequence[torch.device], sizes: Sequence[int],
             repeats: int) -> list[tuple[float, float]]:
    """Ping-pong between two threads through the in-process transport the Pipe uses."""
    transport = ThreadTransport(timeout=60.0)
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


@contextlib.contextmanager
def _group(rank: int, world: int, backend: str, port: int) -> Iterator[torch.device]:
    """This measuring process in a fresh group on loopback, and its device."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        yield device
    finally:
        dist.destroy_process_group()


def _process(rank: int, world: int, backend: str, port: int, sizes: Sequence[int],
             repeats: int, queue: Any) -> None:
    with _group(rank, world, backend, port) as device:
        # The group's send and receive; and where a pipeline would take a same-host link
        # instead (CPU), that link too.
        links = (connect(dist.distributed_c10d._get_default_store(), [0, 1], rank, 60.0)
                 if device.type == "cpu" else {})
        out = [_ping_pong(rank, device, sizes, repeats, None)]
        if links:
            out.append(_ping_pong(rank, device, sizes, repeats, links[1 - rank]))
        if rank == 0:
            queue.put(out)


def _ping_pong(rank: int, device: torch.device, sizes: Sequence[int], repeats: int,
               link: SocketLink | None) -> list[tuple[float, float]]:
    """(bytes, one-way seconds) per size: the median of `repeats` round trips, halved, over
    `link` or else the process group."""
    out = []
    for size in sizes:
        payload = torch.zeros(size // 4, device=device)
        rounds = []
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for sends in ((True, False) if rank == 0 else (False, True)):
                if link is not None:
                    deadline = time.monotonic() + 60
                    if sends:
                        link.send([memory(payload)], payload).wait(deadline)
                    else:
                        link.recv_into([memory(payload)], deadline)
                elif sends:
                    dist.send(payload, 1 - rank)
                else:
                    dist.recv(payload, 1 - rank)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                rounds.append((time.perf_counter() - start) / 2)
        out.append((float(size), statistics.median(rounds)))
    return out


def _allreduce_process(rank: int, world: int, backend: str, port: int, sizes: Sequence[int],
                       repeats: int, queue: Any) -> None:
    """Time `dist.all_reduce` of each size over the group (rank 0 reports the medians)."""
    with _group(rank, world, backend, port) as device:
        out = []
        for size in sizes:
            payload = torch.zeros(size // 4, device=device)
            times = []
            for i in range(repeats + 1):
                dist.barrier()  # every rank starts together: the time is the collective's own
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                dist.all_reduce(payload)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:  # the first call warms up
                    times.append(time.perf_counter() - start)
            out.append((float(size), statistics.median(times)))
        if rank == 0:
            queue.put([out])


def _processes(backend: str, sizes: Sequence[int], repeats: int, target: Any = _process,
               world: int = 2) -> list[list[tuple[float, float]]]:
    """Ping-pong between two fresh processes over `backend` on this machine (loopback), and
    over a same-host link where the pipeline would use one (second list, if any); or, with
    `target=_allreduce_process`, an all-reduce over `world` processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, backend, port, sizes, repeats, queue),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed or queue.empty():
        raise RuntimeError(f"measuring the {backend} link failed (process exit codes "
                           f"{[p.exitcode for p in procs]})")
    result: list[list[tuple[float, float]]] = queue.get()
    return result


def measure_link(transport: str = "threads", *, devices: Sequence[str | torch.device] = ("cpu",
                 "cpu"), sizes: Sequence[int] = _SIZES, repeats: int = 20) -> Link:
    """Measure one-way message time between two ranks over `transport` ("threads": the
    in-process transport between `devices[0]` and `devices[1]`; "gloo" or "nccl": two local
    processes, on CPU or on GPUs 0 and 1) for each size in `sizes` (bytes; median of
    `repeats` round trips, halved) and fit `latency + bytes * per_byte`. Two CPU processes
    talk as a pipeline's would, over a same-host link (`pipeline.comm.same_host`) unless links
    are off; the group's own send and receive then give `collective_latency` and
    `collective_per_byte`, which the dp all-reduce uses."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} (got {transport!r})")
    if len(sizes) < 2 or repeats < 1:
        raise ValueError(f"need at least two sizes and one repeat (got {list(sizes)}, "
                         f"{repeats})")
    if transport == "threads":
        pair = [torch.device(d) for d in devices]
        samples = _threads(pair if len(pair) > 1 else pair * 2, sizes, repeats)
        latency, per_byte = _fit(samples)
        return Link(transport, latency, per_byte)
    group, *linked = _processes(transport, sizes, repeats)
    latency, per_byte = _fit(group)
    if not linked:
        return Link(transport, latency, per_byte)
    # A pipeline's messages go over the link; the dp all-reduce over the group.
    return Link(transport, *_fit(linked[0]), collective_latency=latency,
                collective_per_byte=per_byte)


def ring_fit(samples: Sequence[tuple[float, float]], ranks: int) -> tuple[float, float]:
    """(latency, per_byte) of one ring step from all-reduce times over `ranks` ranks: a ring
    all-reduce of `n` bytes takes 2(r-1) steps of latency + n/r bytes, so the fitted line
    `a + b n` (`_fit`) gives latency a / 2(r-1) and per_byte b r / 2(r-1)."""
    if ranks < 2:
        raise ValueError(f"an all-reduce needs at least two ranks (got {ranks})")
    a, b = _fit(samples)
    steps = 2 * (ranks - 1)
    return a / steps, b * ranks / steps


def measure_allreduce(transport: str = "gloo", *, ranks: int = 2,
                      sizes: Sequence[int] = _SIZES, repeats: int = 10) -> Link:
    """Measure an all-reduce over `ranks` fresh local processes over `transport` ("gloo": CPU;
    "nccl": GPUs 0..ranks-1, the host's own link) for each size in `sizes` (bytes; median of
    `repeats` after a warm-up) and fit the ring model (`ring_fit`). The `Link` it returns
    costs a message and a collective step alike, so `link.allreduce(n, ranks)` reproduces the
    measurement; pass it as `plan(host_link=...)` for tensor parallelism's collectives (other
    group sizes extrapolate the ring model)."""
    if transport not in ("gloo", "nccl"):
        raise ValueError(f"transport must be 'gloo' or 'nccl' for an all-reduce between "
                         f"processes (got {transport!r})")
    if ranks < 2 or len(sizes) < 2 or repeats < 1:
        raise ValueError(f"need at least two ranks, two sizes and one repeat (got {ranks}, "
                         f"{list(sizes)}, {repeats})")
    if transport == "nccl" and torch.cuda.device_count() < ranks:
        raise ValueError(f"an nccl all-reduce over {ranks} ranks needs {ranks} GPUs on this "
                         f"host ({torch.cuda.device_count()} visible)")
    (samples,) = _processes(transport, sizes, repeats, target=_allreduce_process, world=ranks)
    latency, per_byte = ring_fit(samples, ranks)
    return Link(transport, latency, per_byte, collective_latency=latency,
                collective_per_byte=per_byte)
