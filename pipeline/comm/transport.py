"""How stages hand activations and gradients to each other: the interface and the in-process one."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pipeline.runtime.microbatch import like
from schedules import Schedule
from schedules.lower import Message

__all__ = [
    "PeerTimeout",
    "PipelineAborted",
    "ThreadTransport",
    "Transport",
    "describe_message",
    "move",
]


class PipelineAborted(RuntimeError):
    """Raised in a worker when another rank has failed; carries the failed rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class PeerTimeout(TimeoutError):
    """A wait for a peer's message gave up: names the peer (`src`) and what was awaited."""

    def __init__(self, rank: int | None, src: int, what: str, seconds: float) -> None:
        waiter = "" if rank is None else f"rank {rank} "
        super().__init__(f"{waiter}waited {seconds:g}s for {what} from rank {src}; raise "
                         f"Pipe(timeout=...) if a stage is really that slow")
        self.src, self.what, self.seconds = src, what, seconds


def describe_message(msg: Message) -> str:
    """'the activations of stage 1, micro-batch 0' (or gradients) for error messages."""
    kind, stage, microbatch = msg
    what = "activations" if kind == "F" else "gradients"
    return f"the {what} of stage {stage}, micro-batch {microbatch}"


class Transport(Protocol):
    """Point-to-point messages named by `schedules.lower`'s `Message` (kind, stage, micro-batch).

    The runtime calls `begin` with the lowered schedule, `send` at each SEND, `post` at each
    RECV (posting never blocks), `wait` right before the compute that needs the data, and
    `finish` at the end of the step. A message is a tuple whose tensors arrive on the
    receiver's device; `None` entries stay None. Tensors that required grad on the sender come
    back as fresh leaves requiring grad.
    """

    # Whether `send` is done with the values when it returns (it copied them into its own
    # buffer): the sender may then release a stage output's storage.
    copies: bool

    def begin(self, schedule: Schedule) -> None: ...

    def send(self, msg: Message, values: tuple[Any, ...], dst_rank: int) -> None: ...

    def post(self, msg: Message, src_rank: int) -> None: ...

    def wait(self, msg: Message, src_rank: int, device: torch.device) -> tuple[Any, ...]: ...

    def finish(self) -> None: ...

    def abort(self, rank: int, message: str) -> None: ...


def move(values: Sequence[Any], device: torch.device, *, grad_flags: Sequence[bool] | None = None
         ) -> tuple[Any, ...]:
    """Tensors onto `device` (non-blocking where the copy allows it), detached; those flagged
    become leaves that require grad, so the receiving stage can hand back their gradients."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if v.device != device:
                v = v.to(device, non_blocking=True)
            if grad_flags is not None and grad_flags[i]:
                v.requires_grad_(True)
        out.append(v)
    return like(values, out)


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

    def abort(self, rank: int, message: str) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = (rank, message)
            self._cond.notify_all()
