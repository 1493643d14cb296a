"""How stages hand activations and gradients to each other: the interface and the in-process one."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["LocalTransport", "PipelineAborted", "Transport", "move"]


class PipelineAborted(RuntimeError):
    """Raised in a worker when another rank has failed; carries the failed rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class Transport(Protocol):
    """Point-to-point messages keyed by (kind, stage, micro-batch).

    `kind` is "F" (activations for `stage`'s forward) or "B" (gradients for `stage`'s backward).
    A message is a tuple whose tensors arrive on the receiver's device; `None` entries stay None.
    Tensors that required grad on the sender come back as fresh leaves requiring grad.
    """

    def send(self, kind: str, stage: int, microbatch: int, values: tuple[Any, ...],
             dst_rank: int) -> None: ...

    def recv(self, kind: str, stage: int, microbatch: int, src_rank: int,
             device: torch.device) -> tuple[Any, ...]: ...

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
    return tuple(out)


class LocalTransport:
    """A mailbox shared by the worker threads of one process.

    On CUDA the receiver copies on a side stream after waiting for the event the sender recorded
    when the data was ready, and its compute stream waits for that copy: transfers overlap with
    compute and no thread blocks on the device.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._box: dict[tuple[str, int, int], tuple[tuple[Any, ...], Any]] = {}
        self._cond = threading.Condition()
        self._failed: tuple[int, str] | None = None
        self._streams: dict[torch.device, Any] = {}

    def send(self, kind: str, stage: int, microbatch: int, values: tuple[Any, ...],
             dst_rank: int) -> None:
        del dst_rank  # one mailbox serves every rank
        event = None
        cuda = [v for v in values if isinstance(v, torch.Tensor) and v.is_cuda]
        if cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(cuda[0].device))
        with self._cond:
            self._box[(kind, stage, microbatch)] = (values, event)
            self._cond.notify_all()

    def recv(self, kind: str, stage: int, microbatch: int, src_rank: int,
             device: torch.device) -> tuple[Any, ...]:
        key = (kind, stage, microbatch)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while key not in self._box:
                if self._failed is not None:
                    raise PipelineAborted(*self._failed)
                left = deadline - time.monotonic()
                if left <= 0:
                    what = "activations" if kind == "F" else "gradients"
                    raise TimeoutError(
                        f"waited {self.timeout:.0f}s for the {what} of stage {stage}, micro-batch "
                        f"{microbatch} from rank {src_rank}; raise Pipe(timeout=...) if a stage "
                        f"is really that slow"
                    )
                self._cond.wait(min(left, 1.0))
            values, event = self._box.pop(key)
        flags = [isinstance(v, torch.Tensor) and v.requires_grad for v in values]
        if device.type != "cuda" or event is None:
            return move(values, device, grad_flags=flags)
        return self._recv_cuda(values, event, device, flags)

    def _recv_cuda(self, values: tuple[Any, ...], event: Any, device: torch.device,
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

    def abort(self, rank: int, message: str) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = (rank, message)
            self._cond.notify_all()
