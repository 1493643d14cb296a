"""Waiting for torch.distributed work without ever hanging: polling, a helper thread, a deadline."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Waiter", "poll"]


class Waiter:
    """A daemon thread that blocks in `work.wait()` on behalf of another thread, in order."""

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
            # Hold no finished work while blocked in the next get(): it would be freed on this
            # thread at its next wake-up, possibly during interpreter finalisation.
            del work, error
            event.set()


def poll(work: Any, *, polls: bool, waiter: Waiter, timeout: float,
         on_tick: Callable[[float], None], what: str) -> None:
    """Wait for `work`, calling `on_tick(now)` while waiting (it raises to give up), and raise
    `TimeoutError(what.format(timeout))` after `timeout` seconds.

    NCCL work can be polled (`is_completed`); gloo's point-to-point work only completes inside
    a blocking `wait()`, so the `waiter` thread blocks there and this thread watches.
    Errors of the work itself are raised as they are (a `RuntimeError` from the backend).
    """
    deadline = time.monotonic() + timeout
    error: list[BaseException] = []
    event = None
    if not polls:
        event, error = waiter.submit(work)
    pause = 0.0
    while True:
        if event is None:
            if work.is_completed():
                break
            # Spin briefly (transfers usually finish within microseconds), then back off.
            pause = min(pause * 2 + 1e-6, 1e-3)
            time.sleep(pause)
            if work.is_completed():  # done while asleep: no failure check on its way
                break
        elif event.wait(0.05):  # wakes as soon as the helper's wait() returns
            break
        now = time.monotonic()
        on_tick(now)
        if now > deadline:
            raise TimeoutError(what.format(timeout) + "; raise Pipe(timeout=...) if a stage is "
                               "really that slow")
    if error:
        raise error[0]
    if polls:
        work.wait()  # NCCL: orders this stream after the transfer
