"""Ordered messages with one peer: the Channel interface and its same-host link implementation."""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from pipeline.comm.failures import poison_flag
from pipeline.comm.same_host import SocketLink
from pipeline.comm.transport import Done, Pending, Tick
from pipeline.comm.wire import (
    DATA,
    FLAG,
    HEADER,
    SHAPES,
    Meta,
    allocate,
    parts,
    read_header_bytes,
)
from schedules.lower import Message

__all__ = ["RESULT", "BadFlag", "Channel", "LinkChannel", "Received"]

RESULT: Message = ("S", 0, 0)  # messages outside the schedule (results, checkpoints)
# A message's values and which of them required grad on the sender.
Received = tuple[tuple[Any, ...], list[bool]]


class BadFlag(Exception):
    """A message opened with a flag that is neither data nor new shapes: a poison naming the
    rank that failed, or garbage. `agreed`: whether shapes had been agreed before."""

    def __init__(self, flag: int, agreed: bool) -> None:
        super().__init__(flag)
        self.flag, self.agreed = flag, agreed


class Channel(Protocol):
    """Messages to and from one peer, each way in the sender's order.

    Both ends remember the shapes last used for each message (`Message`, or `RESULT`) and
    send only a flag while they hold; a change sends the header first. Receiving raises
    `wire.BadHeader`, `BadFlag`, `transport.Broken` or TimeoutError; the transport names the
    peer.
    """

    def plan(self, sends: Sequence[Message], receives: Sequence[Message]) -> None:
        """This step's messages to the peer and from it, in order (from the lowered
        schedule)."""
        ...

    def send(self, msg: Message, values: tuple[Any, ...], meta: Meta) -> None:
        """Start sending `values` (`meta` = `wire.describe(values)`); never blocks. The
        caller may release the values' storage when it returns."""
        ...

    def post(self) -> None:
        """Post the receives of the plan that can be (a stream needs none)."""
        ...

    def expected(self) -> Message | None:
        """The next message of the plan to receive, or None."""
        ...

    def receive(self, deadline: float, tick: Tick) -> tuple[Message, Received]:
        """The next message of the plan, whole."""
        ...

    def receive_result(self, deadline: float, tick: Tick) -> Received:
        """The next message sent outside the schedule (`send(RESULT, ...)`)."""
        ...

    def poison(self, rank: int) -> None:
        """Best effort: wake the peer's receive of our next message with a poison naming the
        failed `rank`."""
        ...

    def flushed(self) -> Pending:
        """Done when every send so far has completed."""
        ...

    def close(self) -> None: ...


class LinkChannel:
    """A channel over a same-host link: one `sendmsg` per message, from the tensors' own memory,
    read straight into fresh destination tensors (wire's stream layout)."""

    def __init__(self, link: SocketLink) -> None:
        self.link = link
        self._sent: dict[Message, Meta] = {}
        self._recv: dict[Message, Meta] = {}
        self._expected: deque[Message] = deque()
        self._flag = bytearray(FLAG)
        self._header = bytearray(HEADER * 8)

    def plan(self, sends: Sequence[Message], receives: Sequence[Message]) -> None:
        del sends  # a poison is a bare flag: no need to know what comes next
        self._expected = deque(receives)

    def send(self, msg: Message, values: tuple[Any, ...], meta: Meta) -> None:
        changed = self._sent.get(msg) != meta
        if changed:
            self._sent[msg] = meta
        views, keep = parts(values, meta if changed else None)
        self.link.send(views, keep)

    def post(self) -> None:
        """A stream needs no posted receive."""

    def expected(self) -> Message | None:
        return self._expected[0] if self._expected else None

    def receive(self, deadline: float, tick: Tick) -> tuple[Message, Received]:
        msg = self._expected.popleft()
        return msg, self._read(msg, deadline, tick)

    def receive_result(self, deadline: float, tick: Tick) -> Received:
        return self._read(RESULT, deadline, tick)

    def _read(self, key: Message, deadline: float, tick: Tick) -> Received:
        self.link.recv_into([memoryview(self._flag)], deadline, tick)
        (flag,) = struct.unpack("<q", self._flag)
        meta = self._recv.get(key)
        if flag == SHAPES:
            self.link.recv_into([memoryview(self._header)], deadline, tick)
            meta = self._recv[key] = read_header_bytes(self._header)
        elif flag != DATA or meta is None:
            raise BadFlag(flag, meta is not None)
        values, flags, views = allocate(meta)
        self.link.recv_into(views, deadline, tick)
        return values, flags

    def poison(self, rank: int) -> None:
        self.link.send([memoryview(struct.pack("<q", poison_flag(rank)))])

    def flushed(self) -> Pending:
        last = self.link.flushed()
        return Done() if last is None else last

    def close(self) -> None:
        self.link.close()
