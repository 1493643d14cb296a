"""The in-process transport: a mailbox shared by the rank threads of one Pipe."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from pipeline.comm.failures import PeerTimeout, PipelineAborted
from pipeline.comm.transport import describe_message, move
from schedules import Schedule
from schedules.lower import Message

__all__ = ["ThreadTransport"]


class ThreadTransport:
    """A mailbox shared by the worker threads of one process, for the life of a Pipe.

    On CUDA the receiver copies on a side stream after waiting for the event the sender recorded
    when the data was ready, and its compute stream waits for that copy: transfers overlap with
    compute and no thread blocks on the device. A waiting thread sleeps on a condition variable
    (the GIL is released).
    """

    copies = False  # the receiver takes the sender's tensors themselves

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._box: dict[Message, tuple[tuple[Any, ...], Any]] = {}
        self._cond = threading.Condition()
        self._failed: tuple[int, str] | None = None
        self._streams: dict[torch.device, Any] = {}
        self.waiting: set[Message] = set()  # messages a rank is blocked on right now

    def waiting_now(self) -> set[Message]:
        """A snapshot of `waiting`, taken under the lock the waiting ranks change it under."""
        with self._cond:
            return set(self.waiting)

    def begin(self, schedule: Schedule) -> None:
        """Called once per step before any rank runs: a clean mailbox."""
        del schedule  # one mailbox keyed by message serves every order
        with self._cond:
            self._box.clear()
            self.waiting.clear()
            self._failed = None

    def send(self, msg: Message, values: tuple[Any, ...], dst_rank: int) -> None:
        del dst_rank
        event = None
        if self._failed is not None:
            raise PipelineAborted(*self._failed)
        for v in values:
            if isinstance(v, torch.Tensor) and v.is_cuda:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(v.device))
                break
        with self._cond:
            self._box[msg] = (values, event)
            self._cond.notify_all()

    def post(self, msg: Message, src_rank: int) -> None:
        del msg, src_rank  # a mailbox needs no posted receive

    def wait(self, msg: Message, src_rank: int, device: torch.device) -> tuple[Any, ...]:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            # A failure elsewhere stops this rank even when its data is already here: no work
            # is done for a step that has failed.
            while self._failed is None and msg not in self._box:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.waiting.discard(msg)
                    raise PeerTimeout(None, src_rank, describe_message(msg), self.timeout)
                self.waiting.add(msg)
                self._cond.wait(min(left, 1.0))
            self.waiting.discard(msg)
            if self._failed is not None:
                raise PipelineAborted(*self._failed)
            values, event = self._box.pop(msg)
        flags = [isinstance(v, torch.Tensor) and v.requires_grad for v in values]
        if device.type != "cuda" or event is None:
            return move(values, device, grad_flags=flags)
        return self._wait_cuda(values, event, device, flags)

    def _wait_cuda(self, values: tuple[Any, ...], event: Any, device: torch.device,
                   flags: list[bool]) -> tuple[Any, ...]:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            moved = move(values, device, grad_flags=flags)
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(stream)
        for v in moved:
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(compute)  # the copy stream's allocation is used on compute
        return moved

    def finish(self) -> None:
        """Nothing to wait for: a send is complete once it is in the mailbox."""

    def check_usable(self) -> None:
        """Always usable: `begin` clears a failed step's mailbox."""

    def close(self) -> None:
        """Nothing to release: the mailbox is garbage like any object."""

    def abort(self, rank: int, message: str) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = (rank, message)
            self._cond.notify_all()
