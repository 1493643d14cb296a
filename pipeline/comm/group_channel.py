"""A channel over torch.distributed point to point (gloo, NCCL): flat buffers, early receives.

A message is one flat buffer (wire's `pack`): the flag, then each tensor. Both ends remember
the shapes last used for each message, so the receiver posts a buffer of the agreed size
before the data exists; over gloo it keeps up to `DEPTH` receives of the plan posted ahead, so
a message moves while the receiver is still computing. When a shape changes (uneven
micro-batches the first time, a new batch size), the sender fills the posted buffer with the
flag SHAPES and sends the header and the message after it under another tag: receives posted
ahead stay matched to their messages. NCCL ignores tags, so there the next receive is posted
only once the previous message has arrived whole.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.comm.channels import RESULT, BadFlag, Received
from pipeline.comm.failures import poison_flag
from pipeline.comm.transport import Broken, Tick
from pipeline.comm.waiting import Waiter, poll
from pipeline.comm.wire import (
    DATA,
    HEADER,
    SHAPES,
    Meta,
    buffer_size,
    flag_word,
    pack,
    read_header,
    unpack,
)
from schedules.lower import Message

__all__ = ["DEPTH", "GlooReceive", "GroupChannel", "GroupWork"]

DEPTH = 4  # receives of the plan posted ahead per peer over gloo
# Tags: a schedule message's buffer; its header and buffer after a change; the same for
# messages outside the schedule (posted one at a time, whenever the caller asks).
_DATA, _CHANGED, _RESULT, _RESULT_CHANGED = 0, 1, 2, 3


class GroupWork:
    """torch.distributed work (sends, a collective) as a `transport.Pending`: polled on NCCL;
    over gloo, where point-to-point work completes only inside a blocking `wait()`, a helper
    thread blocks there for all of `works` at once while this one watches for failures."""

    def __init__(self, works: list[Any], *, polls: bool, waiter: Waiter,
                 keep: list[torch.Tensor] | None = None) -> None:
        self.works, self.polls, self.waiter = works, polls, waiter
        self.keep = keep  # the buffers the works read or write, alive until they complete
        self._done = not works

    def done(self) -> bool:
        return self._done or (self.polls and all(w.is_completed() for w in self.works))

    def wait(self, deadline: float, tick: Tick) -> None:
        if self._done:
            return
        try:
            poll(_All(self.works), polls=self.polls, waiter=self.waiter,
                 timeout=max(0.0, deadline - time.monotonic()), on_tick=tick, what="{:g}s")
        except RuntimeError as exc:
            raise Broken(str(exc)) from exc
        self._done, self.keep = True, None


class GlooReceive:
    """A receive posted over gloo, as a `transport.Pending`. Its wait blocks right here (no
    thread hand-off on the critical path) without ticks: it cannot hang, since a failing peer
    poisons it (`GroupChannel.poison`), a dead peer's connection breaks, and the wait gives up
    at the deadline."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self._done = False

    def done(self) -> bool:
        return self._done

    def wait(self, deadline: float, tick: Tick) -> None:
        del tick
        try:
            # At least a millisecond: a zero timeout would mean the backend's default.
            self.work.wait(timedelta(seconds=max(1e-3, deadline - time.monotonic())))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                raise TimeoutError(str(exc)) from None
            raise Broken(str(exc)) from exc
        self._done = True


class _All:
    """Work that is done when every one of `works` is (waited for in order)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class GroupChannel:
    """Messages with one peer over a torch.distributed process group."""

    def __init__(self, peer: int, *, group: dist.ProcessGroup | None, device: torch.device,
                 waiter: Waiter) -> None:
        self.peer = peer  # global rank: isend/irecv address global ranks, whatever the group
        self.group = group
        self.device = device
        self.waiter = waiter
        self.polls = dist.get_backend(group) == "nccl"
        self.depth = 1 if self.polls else DEPTH
        self._sent: dict[Message, Meta] = {}
        self._recv: dict[Message, Meta] = {}
        self._to_send: deque[Message] = deque()
        self._expected: deque[Message] = deque()
        self._posted: deque[tuple[Message, torch.Tensor, GlooReceive | GroupWork]] = deque()
        self._works: list[Any] = []  # sends in flight (their buffers live in the work)
        self._buffers: list[torch.Tensor] = []  # and their buffers, until they complete

    def plan(self, sends: Sequence[Message], receives: Sequence[Message]) -> None:
        self._to_send, self._expected = deque(sends), deque(receives)

    # -- sending ------------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, tag: int) -> None:
        try:
            self._works.append(dist.isend(tensor, self.peer, group=self.group, tag=tag))
        except RuntimeError as exc:
            raise Broken(str(exc)) from exc
        self._buffers.append(tensor)

    def send(self, msg: Message, values: tuple[Any, ...], meta: Meta) -> None:
        tag = _RESULT if msg == RESULT else _DATA
        agreed = self._sent.get(msg)
        if agreed != meta:
            # The receiver posted a buffer shaped as agreed: say "changed" in it, then send
            # the new shapes and the message under the next tag.
            notice = torch.zeros(buffer_size(agreed), dtype=torch.uint8, device=self.device)
            flag_word(notice, SHAPES)
            self._isend(notice, tag)
            header = torch.zeros(HEADER, dtype=torch.int64)
            header[:len(meta)] = torch.tensor(meta, dtype=torch.int64)
            self._isend(header.to(self.device), tag + 1)
            self._sent[msg] = meta
            tag += 1
        self._isend(pack(values, meta, self.device), tag)
        if self._to_send and self._to_send[0] == msg:
            self._to_send.popleft()
        while self.polls and self._works and self._works[0].is_completed():
            self._works.pop(0).wait()  # NCCL: orders this stream after the transfer
            self._buffers.pop(0)
        if not self.polls:
            # gloo writes from its own I/O thread; with every core busy computing, that thread
            # can wait a whole scheduler slice (milliseconds) before the data leaves. Offer it
            # the core now: the peer is likely waiting for exactly this message.
            os.sched_yield()

    def flushed(self) -> GroupWork:
        works, keep, self._works, self._buffers = self._works, self._buffers, [], []
        return GroupWork(works, polls=self.polls, waiter=self.waiter, keep=keep)

    def poison(self, rank: int) -> None:
        meta = self._sent.get(self._to_send[0]) if self._to_send else None
        poison = torch.zeros(buffer_size(meta), dtype=torch.uint8, device=self.device)
        flag_word(poison, poison_flag(rank))
        dist.isend(poison, self.peer, group=self.group, tag=_DATA)

    # -- receiving ----------------------------------------------------------------------------
    def _irecv(self, size: int, dtype: torch.dtype, tag: int, *, blocking: bool
               ) -> tuple[torch.Tensor, GlooReceive | GroupWork]:
        buf = torch.empty(size, dtype=dtype, device=self.device)
        try:
            work = dist.irecv(buf, self.peer, group=self.group, tag=tag)
        except RuntimeError as exc:
            raise Broken(str(exc)) from exc
        if blocking and not self.polls:
            return buf, GlooReceive(work)
        return buf, GroupWork([work], polls=self.polls, waiter=self.waiter)

    def post(self) -> None:
        while self._expected and len(self._posted) < self.depth:
            msg = self._expected.popleft()
            buf, pending = self._irecv(buffer_size(self._recv.get(msg)), torch.uint8, _DATA,
                                       blocking=True)
            self._posted.append((msg, buf, pending))

    def expected(self) -> Message | None:
        if self._posted:
            return self._posted[0][0]
        return self._expected[0] if self._expected else None

    def receive(self, deadline: float, tick: Tick) -> tuple[Message, Received]:
        self.post()
        msg, buf, pending = self._posted.popleft()
        pending.wait(deadline, tick)
        buf, meta = self._changed(msg, buf, _CHANGED, deadline, tick)
        self.post()  # the next receives go out before anything else
        return msg, unpack(buf, meta)

    def receive_result(self, deadline: float, tick: Tick) -> Received:
        buf, pending = self._irecv(buffer_size(self._recv.get(RESULT)), torch.uint8, _RESULT,
                                   blocking=False)
        pending.wait(deadline, tick)
        return unpack(*self._changed(RESULT, buf, _RESULT_CHANGED, deadline, tick))

    def _changed(self, key: Message, buf: torch.Tensor, tag: int, deadline: float, tick: Tick
                 ) -> tuple[torch.Tensor, Meta]:
        """The message's buffer and shapes: `buf` itself, or after the flag SHAPES the
        header (checked) and the buffer that follow it under `tag`."""
        flag = flag_word(buf)
        meta = self._recv.get(key)
        if flag == SHAPES:
            header, pending = self._irecv(HEADER, torch.int64, tag, blocking=True)
            pending.wait(deadline, tick)
            meta = read_header(header.tolist())
            self._recv[key] = meta
            buf, pending = self._irecv(buffer_size(meta), torch.uint8, tag, blocking=True)
            pending.wait(deadline, tick)
        elif flag != DATA or meta is None:
            raise BadFlag(flag, meta is not None)
        return buf, meta

    def close(self) -> None:
        """The process group is the caller's."""
