"""A rank's actions timed on its GPU by CUDA events, on the host clock its timeline counts in.

On a GPU an action's handler only launches kernels: the host's clock around it measures the
launches, not the work. Each action's start and end are also recorded as CUDA events on the
rank's stream (the start where the action has its inputs, as on the host), and the step's
measured timeline takes the GPU's times: a reference event recorded at the run's start is
placed at its host time, and every action at that time plus its GPU time since the reference.
Work still queued on the stream at the run's start (an optimizer step launched between two
steps, say) places every action earlier by what is left of it. Nothing waits for the marks
until the timeline is read: a step returns once its work is launched, so a training loop
queues the next step's host work under this step's kernels, and a timeline nobody reads costs
its events alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from schedules import Event

__all__ = ["GpuClock"]


class GpuClock:
    """Marks one rank's actions on its current CUDA stream: `begin` at the run's start,
    `ready` when an action has its inputs, `done` after its handler; `resolver` hands the run's
    marks to a function that turns its events into the GPU's times when called (waiting for
    the last mark then, not before)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device  # its current stream, whichever device the thread is on
        self._reference: torch.cuda.Event | None = None
        self._host = 0.0
        self._start: torch.cuda.Event | None = None
        self._marks: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self, host: float) -> None:
        """The run starts at `host` seconds on the timeline's clock."""
        self._reference, self._host, self._marks = self._event(), host, []

    def ready(self) -> None:
        """The current action has its inputs (called again after a wait for a peer's)."""
        self._start = self._event()

    def done(self, index: int) -> None:
        """The current action, event `index` of the run, has launched all its work."""
        assert self._start is not None, "ready() before done()"
        self._marks.append((index, self._start, self._event()))
        self._start = None

    def _event(self) -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        mark.record(torch.cuda.current_stream(self._device))
        return mark

    def resolver(self, events: Sequence[Event]) -> Callable[[], list[Event]]:
        """A function giving `events` with each marked one's start and end as the GPU ran it;
        the run's marks go with it (the next run marks anew), so it may be called any time."""
        marks, ref, base = self._marks, self._reference, self._host
        self._marks = []

        def timed() -> list[Event]:
            out = list(events)
            if not marks or ref is None:
                return out
            marks[-1][2].synchronize()
            for index, start, end in marks:
                e = out[index]
                out[index] = Event(e.rank, e.action, base + ref.elapsed_time(start) / 1e3,
                                   base + ref.elapsed_time(end) / 1e3)
            return out
        return timed
