"""The multi-process transport: torch.distributed isend/irecv between the ranks of adjacent stages.

Messages carry tuples of tensors (and None). Their shapes and dtypes travel as a small int64
header the first time a channel (sender, kind, stage) is used and again only when they change,
never as pickled objects. A receiver takes a peer's messages in the order the peer sends them,
which it derives from the schedule (plain data, the same on every rank): earlier messages are
buffered until their consumer runs, so matching never depends on tags and works on NCCL too.
Every wait polls, so a failure anywhere (an error mark in the rendezvous store, a dead peer's
broken connection, or the timeout) turns into an error naming the failed rank, never a hang.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.transport import PipelineAborted, move
from schedules import Op, Schedule

__all__ = ["DistributedTransport", "PeerFailure"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
_HEADER = 64  # int64 slots: [entries, (code, dtype, requires_grad, ndim, *shape) per entry]
_FAILED_KEY = "pipeline/failed"


class PeerFailure(RuntimeError):
    """A peer rank died or its connection broke."""


def _describe(values: tuple[Any, ...]) -> list[int]:
    meta = [len(values)]
    for i, v in enumerate(values):
        if v is None:
            meta += [0]
        elif isinstance(v, torch.Tensor):
            if v.dtype not in _DTYPES:
                raise TypeError(f"cannot send a {v.dtype} tensor between processes "
                                f"(entry {i}); supported: {[str(d) for d in _DTYPES]}")
            meta += [1, _DTYPES.index(v.dtype), int(v.requires_grad), v.dim(), *v.shape]
        else:
            raise TypeError(
                f"a stage output crossing processes must be tensors or None; entry {i} is a "
                f"{type(v).__name__}. Pass non-tensor settings to the layers that need them "
                f"another way (constructor arguments), or keep those layers in one stage"
            )
    if len(meta) > _HEADER:
        raise ValueError(f"a message of {len(values)} entries with these shapes needs a "
                         f"{len(meta)}-slot header; at most {_HEADER} fit")
    return meta


def _parse(meta: list[int]) -> list[tuple[torch.dtype, bool, tuple[int, ...]] | None]:
    out: list[tuple[torch.dtype, bool, tuple[int, ...]] | None] = []
    i = 1
    for _ in range(meta[0]):
        if meta[i] == 0:
            out.append(None)
            i += 1
            continue
        dtype, grad, ndim = _DTYPES[meta[i + 1]], bool(meta[i + 2]), meta[i + 3]
        out.append((dtype, grad, tuple(meta[i + 4:i + 4 + ndim])))
        i += 4 + ndim
    return out


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bool: send the bytes.
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class _Waiter:
    """A daemon thread that blocks in `work.wait()` for the transport's thread, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, threading.Event, list[BaseException]]] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None

    def submit(self, work: Any) -> tuple[threading.Event, list[BaseException]]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pipeline-p2p-wait",
                                            daemon=True)
            self._thread.start()
        event, error = threading.Event(), list[BaseException]()
        self._queue.put((work, event, error))
        return event, error

    def _loop(self) -> None:
        while True:
            work, event, error = self._queue.get()
            try:
                work.wait()
            except BaseException as exc:  # handed to the waiting thread
                error.append(exc)
            event.set()


class DistributedTransport:
    """Point-to-point transport over a torch.distributed process group (gloo or NCCL)."""

    def __init__(self, rank: int, device: torch.device, *, timeout: float,
                 group: dist.ProcessGroup | None = None) -> None:
        self.rank = rank
        self.device = device
        self.timeout = timeout
        self.group = group
        self._comm_device = device if device.type == "cuda" else torch.device("cpu")
        self._store = _default_store()
        self._sent_meta: dict[tuple[int, str, int], list[int]] = {}
        self._recv_meta: dict[tuple[int, str, int], list[int]] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._expected: dict[int, deque[tuple[str, int, int]]] = {}
        self._buffer: dict[tuple[str, int, int], tuple[Any, ...]] = {}
        # peer -> (message key, [(buffer, work) for its flag and its tensors])
        self._posted: dict[int, tuple[tuple[str, int, int], list[tuple[torch.Tensor, Any]]]] = {}
        self._last_check = 0.0
        self._polls = dist.get_backend(group) == "nccl"
        self._waiter = _Waiter()

    def begin(self, schedule: Schedule) -> None:
        """Derive, for each peer, the order in which it will send to this rank."""
        self._buffer.clear()
        self._expected = {}
        last = schedule.num_stages - 1
        for peer, row in enumerate(schedule.actions):
            if peer == self.rank:
                continue
            order: deque[tuple[str, int, int]] = deque()
            for a in row:
                if a.op is Op.F and a.stage < last and schedule.rank_of(a.stage + 1) == self.rank:
                    order.append(("F", a.stage + 1, a.microbatch))
                elif (a.op in (Op.B, Op.I) and a.stage > 0
                      and schedule.rank_of(a.stage - 1) == self.rank):
                    order.append(("B", a.stage - 1, a.microbatch))
            self._expected[peer] = order
            self._post_next(peer)

    # -- sending ------------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        work = dist.isend(tensor, dst, group=self.group)
        self._pending.append((work, tensor))  # keep the buffer alive until the send completes

    def send(self, kind: str, stage: int, microbatch: int, values: tuple[Any, ...],
             dst_rank: int) -> None:
        """Send a flag (0: shapes as last time on this channel; 1: changed), then the tensors.

        The receiver has already posted receives shaped like the last message (it keeps the
        same record), so an unchanged message lands without a handshake. On a change, a zero
        message of the old shapes fills those receives first, then the new header and tensors.
        """
        del microbatch  # the order of sends identifies the micro-batch
        meta = _describe(values)
        channel = (dst_rank, kind, stage)
        cached = self._sent_meta.get(channel)
        changed = cached != meta
        self._isend(torch.tensor([int(changed)], dtype=torch.int64,
                                 device=self._comm_device), dst_rank)
        if changed:
            if cached is not None:
                for entry in _parse(cached):
                    if entry is not None:
                        self._isend(self._empty(entry[2], entry[0], zero=True), dst_rank)
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self._comm_device)
            header[:len(meta)] = torch.tensor(meta, dtype=torch.int64)
            self._isend(header, dst_rank)
            self._sent_meta[channel] = meta
        for v in values:
            if isinstance(v, torch.Tensor):
                self._isend(_wire(v.to(self._comm_device)), dst_rank)
        self._reap()
        if not self._polls:
            # gloo writes from its own I/O thread; with every core busy computing, that thread
            # can wait a whole scheduler slice (milliseconds) before the data leaves. Offer it
            # the core now: the peer is likely waiting for exactly this message.
            os.sched_yield()

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype, *,
               zero: bool = False) -> torch.Tensor:
        wire = torch.uint8 if dtype == torch.bool else dtype
        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=wire, device=self._comm_device)

    def _reap(self) -> None:
        # Only pollable work can be reaped early; gloo sends finish in the background and are
        # waited for at the end of the step.
        while self._polls and self._pending and self._pending[0][0].is_completed():
            work, _ = self._pending.pop(0)
            work.wait()

    def finish(self) -> None:
        """Wait for every send of the step (they complete as peers receive them)."""
        for work, _ in self._pending:
            self._wait(work, "a send to finish", None)
        self._pending.clear()

    # -- receiving ----------------------------------------------------------------------------
    def recv(self, kind: str, stage: int, microbatch: int, src_rank: int,
             device: torch.device) -> tuple[Any, ...]:
        key = (kind, stage, microbatch)
        expected = self._expected.get(src_rank)
        while key not in self._buffer:
            if not expected:
                raise AssertionError(f"rank {self.rank}: {key} is not among what rank "
                                     f"{src_rank} sends under this schedule")
            nxt = expected.popleft()
            self._buffer[nxt] = self._receive(src_rank, nxt)
        values = self._buffer.pop(key)
        flags = [isinstance(v, torch.Tensor) and v.requires_grad for v in values]
        return move(values, device, grad_flags=flags)

    def _post_next(self, src: int) -> None:
        """Post the receives of the next message expected from `src`: its flag, and its tensors
        shaped as the last message on that channel (see `send`)."""
        expected = self._expected.get(src)
        if not expected or src in self._posted:
            return
        kind, stage, _ = expected[0]
        flag = self._empty((1,), torch.int64)
        works = [(flag, dist.irecv(flag, src, group=self.group))]
        meta = self._recv_meta.get((src, kind, stage))
        for entry in _parse(meta) if meta is not None else ():
            if entry is not None:
                buf = self._empty(entry[2], entry[0])
                works.append((buf, dist.irecv(buf, src, group=self.group)))
        self._posted[src] = (expected[0], works)

    def _recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int,
                     what: str) -> torch.Tensor:
        buf = self._empty(shape, dtype)
        self._finish_recv(dist.irecv(buf, src, group=self.group), what, src)
        return buf.view(torch.bool) if dtype == torch.bool else buf

    def _finish_recv(self, work: Any, what: str, src: int) -> None:
        if self._polls:
            self._wait(work, what, src)
        else:
            self._wait_blocking(work, what, src)

    def _wait_blocking(self, work: Any, what: str, src: int) -> None:
        """gloo receive: block right here (no thread hand-off on the critical path).

        It cannot hang: a peer that fails sends every rank a poison flag (see `abort`), a dead
        peer's connection breaks, and the wait itself gives up after the timeout.
        """
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                raise TimeoutError(f"rank {self.rank} waited {self.timeout:.0f}s for {what}; "
                                   f"raise Pipe(timeout=...) if a stage is really that slow"
                                   ) from None
            self._check_failed()
            raise PeerFailure(f"rank {src} is gone (its process died or its connection broke) "
                              f"while rank {self.rank} waited for {what}: {exc}") from exc

    def _receive(self, src: int, key: tuple[str, int, int]) -> tuple[Any, ...]:
        kind, stage, mb = key
        what = (f"the {'activations' if kind == 'F' else 'gradients'} of stage {stage}, "
                f"micro-batch {mb} from rank {src}") if kind in "FB" else (
                f"a result from rank {src}")
        posted = self._posted.pop(src, None)
        if posted is None:  # a message outside the schedule (results): post it now
            self._expected.setdefault(src, deque()).appendleft(key)
            self._post_next(src)
            posted = self._posted.pop(src)
            self._expected[src].popleft()
        assert posted[0] == key, f"rank {self.rank}: posted {posted[0]}, need {key}"
        (flag, flag_work), *prepared = posted[1]
        self._finish_recv(flag_work, what, src)
        changed = int(flag.item())
        if changed < 0:  # poison: a rank failed (see `abort`)
            failed = -changed - 1
            self._check_failed()
            raise PipelineAborted(failed, f"rank {failed} failed (told rank {self.rank} "
                                          f"through rank {src})")
        for _, work in prepared:  # the tensors, or a zero filler when shapes changed
            self._finish_recv(work, what, src)
        channel = (src, kind, stage)
        if changed:
            header = self._recv_tensor((_HEADER,), torch.int64, src, what).tolist()
            self._recv_meta[channel] = header
            tensors = [self._recv_tensor(e[2], e[0], src, what)
                       for e in _parse(header) if e is not None]
        else:
            tensors = [buf for buf, _ in prepared]
        self._post_next(src)  # the next message's receives go out before anything else
        values: list[Any] = []
        received = iter(tensors)
        for entry in _parse(self._recv_meta[channel]):
            if entry is None:
                values.append(None)
                continue
            dtype, grad, _ = entry
            t = next(received)
            t = t.view(torch.bool) if dtype == torch.bool else t
            values.append(t.requires_grad_(True) if grad else t)
        return tuple(values)

    def recv_direct(self, src: int, shape: tuple[int, ...], *,
                    values_dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor sent by `send(..., (tensor,), dst)` outside the schedule (results,
        checkpoints): taken in order, like every message from `src`."""
        out = self._receive(src, ("S", 0, 0))[0]
        assert isinstance(out, torch.Tensor)
        if tuple(out.shape) != shape or values_dtype not in (None, out.dtype):
            raise AssertionError(f"rank {self.rank}: expected {shape} {values_dtype} from rank "
                                 f"{src}, got {tuple(out.shape)} {out.dtype}")
        return out.detach()

    # -- waiting and failing ------------------------------------------------------------------
    def _wait(self, work: Any, what: str, src: int | None) -> None:
        """Wait for `work` while watching for failures elsewhere and for the deadline.

        NCCL work can be polled (`is_completed`); gloo's point-to-point work only completes
        inside a blocking `wait()`, so a helper thread blocks there and this thread watches
        (used for sends at the end of a step, whose peer may have failed after its receives).
        """
        deadline = time.monotonic() + self.timeout
        error: list[BaseException] = []
        event = None
        if not self._polls:
            event, error = self._waiter.submit(work)
        pause = 0.0
        while True:
            if event is None:
                if work.is_completed():
                    break
                # Spin briefly (transfers usually finish within microseconds), then back off.
                pause = min(pause * 2 + 1e-6, 1e-3)
                time.sleep(pause)
            elif event.wait(0.05):  # wakes as soon as the helper's wait() returns
                break
            now = time.monotonic()
            if now - self._last_check > 0.05:
                self._last_check = now
                self._check_failed()
            if now > deadline:
                raise TimeoutError(f"rank {self.rank} waited {self.timeout:.0f}s for {what}; "
                                   f"raise Pipe(timeout=...) if a stage is really that slow")
        try:
            if error:
                raise error[0]
            if self._polls:
                work.wait()  # NCCL: orders this stream after the transfer
        except RuntimeError as exc:
            self._check_failed()
            peer = f"rank {src}" if src is not None else "a peer"
            raise PeerFailure(f"{peer} is gone (its process died or its connection broke) "
                              f"while rank {self.rank} waited for {what}: {exc}") from exc

    def _check_failed(self) -> None:
        if self._store is None:
            return
        try:
            if not self._store.check([_FAILED_KEY]):
                return
            text = self._store.get(_FAILED_KEY).decode()
        except Exception as exc:  # the store lives in rank 0's process
            raise PeerFailure(f"rank {self.rank} lost the rendezvous store (hosted by rank 0; "
                              f"is it dead?): {exc}") from exc
        rank, _, message = text.partition(":")
        raise PipelineAborted(int(rank), message)

    def abort(self, rank: int, message: str) -> None:
        """Tell every rank that `rank` failed: a mark in the store (first writer wins) with the
        message, and a poison flag to every peer, which wakes a receive blocked on this rank;
        a peer blocked on another rank hears it when that rank fails in turn."""
        if self._store is not None:
            # Best effort: if the store is gone, peers still see a broken connection or time out.
            with contextlib.suppress(Exception):
                self._store.compare_set(_FAILED_KEY, "", f"{rank}:{message}")
        poison = torch.tensor([-1 - rank], dtype=torch.int64, device=self._comm_device)
        for peer in range(dist.get_world_size(self.group)):
            if peer != self.rank:
                with contextlib.suppress(Exception):
                    dist.isend(poison, peer, group=self.group)


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: without it, failures surface by timeout
        return None
