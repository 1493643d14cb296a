"""The multi-process transport: torch.distributed isend/irecv between the ranks of adjacent stages.

One message per transfer. A message is one flat byte buffer: an 8-byte flag, then each tensor's
bytes (16-byte aligned); tensors are views into it on arrival, never copied again. Both sides
remember the shapes and dtypes last used for each (peer, message) and agree on the buffer's size
without a handshake: the receiver posts a buffer of that size before the data exists. When a
shape changes (uneven micro-batches the first time, a new batch size), the sender fills the
posted buffer with flag 1 and sends a small int64 header and the new buffer after it. The order
of receives comes from the lowered schedule (`schedules.lower` keeps each pair's receives in the
sender's order), so matching needs no tags and works on NCCL too; a peer's next receive is
posted as soon as its previous message arrives. Every wait watches for failures: an error mark
in the rendezvous store, a poison flag (a failing rank fills each peer's next posted buffer
with its rank), a dead peer's broken connection, or the timeout, so no rank hangs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.comm import failures
from pipeline.comm.failures import PeerFailure, default_store, first_report, guarded
from pipeline.comm.same_host import LinkBroken, SocketLink, connect
from pipeline.comm.transport import PeerTimeout, PipelineAborted, describe_message, move
from pipeline.comm.waiting import Waiter, poll
from pipeline.comm.wire import (
    HEADER,
    BadHeader,
    Meta,
    buffer_size,
    describe,
    flag_word,
    pack,
    read_header,
    unpack,
)
from pipeline.errors import PipelineError
from schedules import Schedule
from schedules.ir import RECV_OPS, SEND_OPS
from schedules.lower import Message, message, source_stage

__all__ = ["PeerFailure", "ProcessTransport"]

_RESULT: Message = ("S", 0, 0)  # messages outside the schedule (results, checkpoints)


class ProcessTransport:
    """Point-to-point transport over a torch.distributed process group (gloo or NCCL)."""

    copies = True  # `send` packs the values into a buffer of its own before it returns

    def __init__(self, rank: int, device: torch.device, *, timeout: float,
                 group: dist.ProcessGroup | None = None,
                 watch: tuple[int, ...] | None = None,
                 names: Callable[[int], str] | None = None) -> None:
        self.rank = rank  # within `group`
        self.device = device
        self.timeout = timeout
        self.group = group
        self.world_size = dist.get_world_size(group)
        # isend/irecv address global ranks, whatever group they go through.
        self._global = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(self.world_size)]
        # Global ranks whose failure reports end this rank's waits: its group's, or a whole
        # mesh's (a failed replica must stop the others too).
        self._watch = list(watch) if watch is not None else self._global
        self.name = names or (lambda r: f"rank {r}")  # a peer in messages (with coordinates)
        self._comm_device = device if device.type == "cuda" else torch.device("cpu")
        self._store = default_store()
        self._sent_meta: dict[tuple[int, Message], Meta] = {}
        self._recv_meta: dict[tuple[int, Message], Meta] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []  # sends in flight, with their buffers
        self._expected: dict[int, deque[Message]] = {}  # per peer: receives still to post
        self._to_send: dict[int, deque[Message]] = {}  # per peer: what it expects from us next
        self._posted: dict[int, tuple[Message, torch.Tensor, Any]] = {}
        self._arrived: dict[Message, tuple[tuple[Any, ...], list[bool]]] = {}
        self._polls = dist.get_backend(group) == "nccl"
        self._waiter = Waiter()
        self._last_check = [0.0]
        self._broken: str | None = None  # the first failure seen: then every call refuses
        # Peers on this host, by group rank: their messages go over a Unix socket instead
        # (see local_link; CPU tensors only: CUDA keeps NCCL's stream-ordered path).
        self._links: dict[int, SocketLink] = (
            connect(self._store, self._global, rank, timeout)
            if self._comm_device.type == "cpu" else {})

    def unusable(self) -> PipelineError:
        """The error every call raises once this transport has seen a failure."""
        return PipelineError(
            f"rank {self.rank}: this pipeline's process group is unusable after an earlier "
            f"failure ({self._broken}): build a new process group and Pipe (restart the ranks)")

    def check_usable(self) -> None:
        if self._broken is not None:
            raise self.unusable()

    @guarded
    def begin(self, schedule: Schedule) -> None:
        """Read this step's order of messages with each peer from the lowered schedule and
        post the first receive from each."""
        self._arrived.clear()
        self._expected, self._to_send = {}, {}
        for a in schedule.actions[self.rank]:
            if a.op in RECV_OPS:  # a program's tied weights too (schedules.program)
                msg = message(a)
                peer = schedule.rank_of(source_stage(msg))
                self._expected.setdefault(peer, deque()).append(msg)
            elif a.op in SEND_OPS:
                msg = message(a)
                self._to_send.setdefault(schedule.rank_of(msg[1]), deque()).append(msg)
        for peer in self._expected:
            self._post_next(peer)

    # -- sending ------------------------------------------------------------------------------
    def _p2p(self, op: Any, tensor: torch.Tensor, peer: int) -> Any:
        """`dist.isend` or `dist.irecv` with `peer`; a broken connection (a peer that died,
        possibly before this step began) becomes a PeerFailure naming it."""
        link = self._links.get(peer)
        try:
            if link is not None:
                return link.send(tensor) if op is dist.isend else (link, tensor)
            return op(tensor, self._global[peer], group=self.group)
        except (RuntimeError, LinkBroken) as exc:
            self._check_failed()
            raise PeerFailure(f"{self.name(peer)} is gone (its process died or its connection "
                              f"broke); rank {self.rank} could not reach it: {exc}") from exc

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        work = self._p2p(dist.isend, tensor, dst)
        self._pending.append((work, tensor))  # keep the buffer alive until the send completes

    @guarded
    def send(self, msg: Message, values: tuple[Any, ...], dst_rank: int) -> None:
        self._tick(time.monotonic())  # a failed step computes and sends nothing more
        meta = describe(values)
        key = (dst_rank, msg)
        agreed = self._sent_meta.get(key)
        if agreed != meta:
            # The receiver posted a buffer shaped as agreed: say "changed" in it, then send
            # the new shapes and the message.
            notice = torch.zeros(buffer_size(agreed), dtype=torch.uint8, device=self._comm_device)
            flag_word(notice, 1)
            self._isend(notice, dst_rank)
            header = torch.zeros(HEADER, dtype=torch.int64)
            header[:len(meta)] = torch.tensor(meta, dtype=torch.int64)
            self._isend(header.to(self._comm_device), dst_rank)
            self._sent_meta[key] = meta
        self._isend(pack(values, meta, self._comm_device), dst_rank)
        plan = self._to_send.get(dst_rank)
        if plan and plan[0] == msg:
            plan.popleft()
        self._reap()
        if not self._polls and dst_rank not in self._links:
            # gloo writes from its own I/O thread; with every core busy computing, that thread
            # can wait a whole scheduler slice (milliseconds) before the data leaves. Offer it
            # the core now: the peer is likely waiting for exactly this message.
            os.sched_yield()

    def _reap(self) -> None:
        # Only pollable work can be reaped early; gloo sends finish in the background and are
        # waited for at the end of the step.
        while self._polls and self._pending and self._pending[0][0].is_completed():
            work, _ = self._pending.pop(0)
            work.wait()

    @guarded
    def finish(self) -> None:
        """Wait for every send of the step (they complete as peers receive them)."""
        deadline = time.monotonic() + self.timeout
        works = []
        for work, _ in self._pending:
            if not hasattr(work, "tensor"):  # a link's send: done, or its writer finishes it
                works.append(work)
                continue
            try:
                work.wait(deadline, self._tick)
            except TimeoutError:
                raise TimeoutError(f"rank {self.rank} waited {self.timeout:g}s for a send to "
                                   f"finish") from None
            except LinkBroken as exc:
                self._check_failed()
                raise PeerFailure(f"a peer of rank {self.rank} is gone (its process died or "
                                  f"its connection broke) while it sent to it: {exc}") from exc
        if works and not self._polls:
            # gloo: one hand-off to the waiter thread for all of them, not one per send (each
            # costs two thread switches; by now nearly every send has long completed).
            self._wait(_All(works), "the step's sends to finish", None)
        else:
            for work in works:
                self._wait(work, "a send to finish", None)
        self._pending.clear()

    # -- receiving ----------------------------------------------------------------------------
    @guarded
    def post(self, msg: Message, src_rank: int) -> None:
        """A RECV: the receive is posted by now (usually it was, when the previous message
        from `src_rank` arrived)."""
        if src_rank not in self._posted and msg not in self._arrived:
            self._post_next(src_rank)

    @guarded
    def wait(self, msg: Message, src_rank: int, device: torch.device) -> tuple[Any, ...]:
        self._tick(time.monotonic())  # even when the data is here: no work for a failed step
        while msg not in self._arrived:
            posted = self._posted.get(src_rank)
            if posted is None:
                raise AssertionError(f"rank {self.rank}: {msg} is not among what rank "
                                     f"{src_rank} sends under this schedule")
            self._arrived[posted[0]] = self._receive(src_rank)
        values, flags = self._arrived.pop(msg)
        return move(values, device, grad_flags=flags)

    def _post_next(self, src: int) -> None:
        expected = self._expected.get(src)
        if not expected or src in self._posted:
            return
        msg = expected.popleft()
        buf = torch.empty(buffer_size(self._recv_meta.get((src, msg))), dtype=torch.uint8,
                          device=self._comm_device)
        self._posted[src] = (msg, buf, self._p2p(dist.irecv, buf, src))

    def _recv_now(self, size: int, dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
        buf = torch.empty(size, dtype=dtype, device=self._comm_device)
        self._finish_recv(self._p2p(dist.irecv, buf, src), what, src)
        return buf

    def _receive(self, src: int) -> tuple[tuple[Any, ...], list[bool]]:
        """Complete the receive posted for `src`, post its next one, and unpack."""
        msg, buf, work = self._posted.pop(src)
        what = describe_message(msg) if msg[0] in "FB" else "a result"
        self._finish_recv(work, what, src)
        flag = flag_word(buf)
        meta = self._recv_meta.get((src, msg))
        if flag < 0 and -flag - 1 < self.world_size:  # poison: a rank failed (see `abort`)
            failed = -flag - 1
            self._check_failed()
            raise PipelineAborted(failed, f"{self.name(failed)} failed (told rank {self.rank} "
                                          f"through {self.name(src)})")
        if flag == 1:  # new shapes: the header, then the message itself
            header = self._recv_now(HEADER, torch.int64, src, what).tolist()
            try:
                meta = read_header(header)
                size = buffer_size(meta)
            except BadHeader as exc:
                raise PipelineError(f"rank {self.rank}: {self.name(src)} sent {what} with a "
                                    f"bad header: {exc}") from None
            self._recv_meta[(src, msg)] = meta
            buf = self._recv_now(size, torch.uint8, src, what)
        elif flag != 0 or meta is None:
            expected = (f"0 (data), 1 (new shapes) or a poison -1 to -{self.world_size}"
                        if meta is not None else "1 (new shapes) first")
            raise PipelineError(f"rank {self.rank}: {self.name(src)} sent {what} with flag "
                                f"{flag}{' before any header' if meta is None else ''}; "
                                f"expected {expected}")
        self._post_next(src)  # the next message's receive goes out before anything else
        return unpack(buf, meta)

    def _finish_recv(self, work: Any, what: str, src: int) -> None:
        if isinstance(work, tuple):  # a link: read the bytes now, in this thread
            link, buf = work
            try:
                link.recv_into(buf, time.monotonic() + self.timeout, self._tick)
            except TimeoutError:
                self._check_failed()
                raise PeerTimeout(self.rank, src, what, self.timeout) from None
            except LinkBroken as exc:
                self._check_failed()
                raise PeerFailure(f"{self.name(src)} is gone (its process died or its "
                                  f"connection broke) while rank {self.rank} waited for {what} "
                                  f"from it: {exc}") from exc
            return
        if self._polls:
            self._wait(work, what, src)
            return
        # gloo: block right here (no thread hand-off on the critical path). It cannot hang: a
        # failing peer poisons this receive (see `abort`), a dead peer's connection breaks,
        # and the wait itself gives up after the timeout.
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                self._check_failed()  # a failure elsewhere explains the silence
                raise PeerTimeout(self.rank, src, what, self.timeout) from None
            self._check_failed()
            raise PeerFailure(f"{self.name(src)} is gone (its process died or its connection "
                              f"broke) while rank {self.rank} waited for {what} from it: {exc}"
                              ) from exc

    # -- messages outside the schedule --------------------------------------------------------
    @guarded
    def send_result(self, tensor: torch.Tensor, dst: int) -> None:
        """One tensor to `dst` outside the schedule (results, checkpoints), in order."""
        self.send(_RESULT, (tensor,), dst)

    @guarded
    def recv_result(self, src: int, shape: tuple[int, ...],
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        """The next tensor `src` sent with `send_result`, which must have this shape (and
        dtype, if given)."""
        self._expected.setdefault(src, deque()).appendleft(_RESULT)
        self._post_next(src)
        values, _ = self._receive(src)
        out = values[0] if len(values) == 1 else None
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape
                or dtype not in (None, out.dtype)):
            got = (f"shape {tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor)
                   else f"{len(values)} entries")
            raise PipelineError(f"rank {self.rank}: {self.name(src)} sent a result of {got}; "
                                f"expected {shape} {dtype or ''}".rstrip())
        return out.detach().clone()

    @guarded
    def exchange(self, payload: str) -> list[str]:
        """Every rank's `payload`, in rank order (the same list on every rank), point to point
        with the failure-aware waits: a peer that is already dead is named, not waited for."""
        data = torch.tensor(list(payload.encode("utf-8")), dtype=torch.uint8)
        for peer in range(self.world_size):
            if peer != self.rank:
                self.send_result(torch.tensor([data.numel()]), peer)
                self.send_result(data, peer)
        out = []
        for peer in range(self.world_size):
            if peer == self.rank:
                out.append(payload)
                continue
            (size,) = self.recv_result(peer, (1,)).tolist()
            raw = self.recv_result(peer, (int(size),), torch.uint8)
            out.append(bytes(raw.tolist()).decode("utf-8"))
        self.finish()
        return out

    def close(self) -> None:
        """Close the same-host links (a peer still talking over one hears that this rank is
        gone); the process group is the caller's."""
        for link in self._links.values():
            link.close()

    # -- waiting and failing ------------------------------------------------------------------
    @guarded
    def wait_work(self, work: Any, what: str) -> None:
        """Wait for any torch.distributed work (a collective too) with the failure-aware
        waits: a failure reported anywhere this transport watches ends it."""
        self._wait(work, what, None)

    def _wait(self, work: Any, what: str, src: int | None) -> None:
        try:
            poll(work, polls=self._polls, waiter=self._waiter, timeout=self.timeout,
                 on_tick=self._tick, what=f"rank {self.rank} waited {{:g}}s for {what}")
        except TimeoutError:
            if src is None:
                raise
            raise PeerTimeout(self.rank, src, what, self.timeout) from None
        except RuntimeError as exc:
            self._check_failed()
            others = [r for r in range(self.world_size) if r != self.rank]
            peer = (self.name(src) if src is not None else self.name(others[0])
                    if len(others) == 1 else "one of " + ", ".join(map(self.name, others)))
            raise PeerFailure(f"{peer} is gone (its process died or its connection broke) "
                              f"while rank {self.rank} waited for {what}: {exc}") from exc

    def _tick(self, now: float) -> None:
        if now - self._last_check[0] > 0.05:
            self._last_check[0] = now
            self._check_failed()

    def _check_failed(self) -> None:
        """Raise PipelineAborted with the first failure any rank of this pipeline reported."""
        if self._store is None:
            return
        try:
            first = first_report(self._store, self._watch)
        except Exception as exc:  # outside launchers that host it, rank 0 hosts the store
            raise PeerFailure(f"rank {self.rank} lost the rendezvous store (rank 0 hosts it "
                              f"unless a launcher does; did rank 0 exit?): {exc}") from exc
        if first is not None:
            raise PipelineAborted(*first)

    def abort(self, rank: int, note: str, *, report: bool = True) -> None:
        """Tell every rank that this rank (`rank`) failed: a report in the store under a key
        only this rank writes, ticketed so that readers pick the first failure, and a poison
        flag in the buffer each peer posted for our next message to it, which wakes a receive
        blocked on this rank; a peer blocked on another rank hears it when that rank fails in
        turn."""
        if self._broken is None:
            self._broken = note
        if report and self._store is not None:
            failures.report(self._store, self._global[self.rank], note)
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            plan = self._to_send.get(peer)
            meta = self._sent_meta.get((peer, plan[0])) if plan else None
            poison = torch.zeros(buffer_size(meta), dtype=torch.uint8, device=self._comm_device)
            flag_word(poison, -1 - rank)
            with contextlib.suppress(Exception):
                link = self._links.get(peer)
                if link is not None:
                    link.send(poison)
                else:
                    dist.isend(poison, self._global[peer], group=self.group)


class _All:
    """Work that is done when every one of `works` is (waited for in order)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
