"""How stages hand activations and gradients to each other: the Transport and Pending interfaces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from pipeline.comm.failures import PeerTimeout, PipelineAborted
from pipeline.runtime.microbatch import like
from schedules import Schedule
from schedules.lower import Message

__all__ = [
    "Broken",
    "Done",
    "PeerTimeout",
    "Pending",
    "PipelineAborted",
    "Tick",
    "Transport",
    "describe_message",
    "move",
]

# Called with time.monotonic() between the polls of a wait; it raises to give the wait up (a
# failure reported elsewhere).
Tick = Callable[[float], None]


class Broken(ConnectionError):
    """The peer is gone (its process died) or the connection to it broke."""


class Pending(Protocol):
    """Communication under way: a send, a posted receive, a collective.

    Each backend has its own (`same_host.LinkSend`, `group_channel.GroupWork`): callers never
    ask which one they hold.
    """

    def done(self) -> bool:
        """Whether it has completed (without waiting)."""
        ...

    def wait(self, deadline: float, tick: Tick) -> None:
        """Until it completes: `tick(now)` runs while waiting, TimeoutError after `deadline`
        (monotonic), `Broken` when the peer is gone."""
        ...


class Done:
    """A Pending that has already completed."""

    def done(self) -> bool:
        return True

    def wait(self, deadline: float, tick: Tick) -> None:
        del deadline, tick


def describe_message(msg: Message) -> str:
    """'the activations of stage 1, micro-batch 0' (or gradients) for error messages."""
    kind, stage, microbatch = msg
    what = {"F": "activations", "B": "gradients"}.get(kind, f"message {kind!r}")
    return f"the {what} of stage {stage}, micro-batch {microbatch}"


class Transport(Protocol):
    """Point-to-point messages named by `schedules.lower`'s `Message` (kind, stage, micro-batch).

    The runtime calls `begin` with the lowered schedule, `send` at each SEND, `post` at each
    RECV (posting never blocks), `wait` right before the compute that needs the data, and
    `finish` at the end of the step. A message is a tuple whose tensors arrive on the
    receiver's device; `None` entries stay None. Tensors that required grad on the sender come
    back as fresh leaves requiring grad. Implementations: `threads.ThreadTransport` (ranks as
    threads of one process) and `process_group.ProcessTransport` (one process per rank, over a
    same-host link or torch.distributed per peer).
    """

    # Whether the sender may release a stage output's storage once `send` returns (the
    # transport copied the bytes, or holds its own reference until they are written).
    copies: bool

    def begin(self, schedule: Schedule) -> None: ...

    def send(self, msg: Message, values: tuple[Any, ...], dst_rank: int) -> None: ...

    def post(self, msg: Message, src_rank: int) -> None: ...

    def wait(self, msg: Message, src_rank: int, device: torch.device) -> tuple[Any, ...]: ...

    def finish(self) -> None: ...

    def abort(self, rank: int, message: str) -> None: ...

    def check_usable(self) -> None:
        """Raise if an earlier failure left the transport unusable."""
        ...

    def close(self) -> None: ...


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
