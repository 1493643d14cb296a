"""The kernel's per-thread run-queue accounting (schedstat): parsed, and read by the thread itself.

Linux keeps, per thread, the nanoseconds it ran and the nanoseconds it spent runnable but not
running, waiting on a CPU's run queue: `/proc/<pid>/task/<tid>/schedstat`, its first two
fields, where the kernel has CONFIG_SCHED_INFO. The kernel adds a wait there once the thread
runs again, so a thread that reads its own counters sees every wait up to that read.

The kernel writes these files and no user can, so they are read as they are, not through the
file gate.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["PROC", "ThreadWait", "not_kept", "parse", "waited_between"]

PROC = Path("/proc")


def parse(text: str) -> tuple[int, int] | None:
    """(nanoseconds run, nanoseconds waited on a run queue) of a schedstat file's text; None
    where it is not '<run ns> <wait ns> <slices>'."""
    fields = text.split()
    if len(fields) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None
    return int(fields[0]), int(fields[1])


def waited_between(start: int | None, end: int | None) -> float:
    """Seconds between two reads of one thread's run-queue wait (0 where either is unknown)."""
    return 0.0 if start is None or end is None else max(end - start, 0) / 1e9


def not_kept(path: Path) -> str:
    """What to say where `path` (a schedstat file) is missing or unreadable."""
    return (f"this kernel keeps no run-queue waits ({path} is missing or not "
            f"'<run ns> <wait ns> <slices>': CONFIG_SCHED_INFO)")


def _stderr_note(text: str) -> None:
    print(f"pipeline: {text}", file=sys.stderr, flush=True)


class ThreadWait:
    """Called: the nanoseconds the calling thread has waited on a run queue so far, from
    `proc` (a directory laid out as /proc; a test passes its own); None where the kernel keeps
    none, which `note` is told once (every later call answers None without a read). Two reads
    around a span give the wait within it: the reading thread runs at each read, so every wait
    before it has been added."""

    def __init__(self, proc: str | os.PathLike[str] = PROC,
                 note: Callable[[str], None] = _stderr_note) -> None:
        self.proc, self.note = Path(proc), note
        self.kept = True  # False once the calling thread's schedstat was missing or malformed

    def __call__(self) -> int | None:
        if not self.kept:
            return None
        # By pid and thread id, not /proc/thread-self: the same layout a test lays out.
        path = self.proc / str(os.getpid()) / "task" / str(threading.get_native_id()) / "schedstat"
        try:
            counters = parse(path.read_text())
        except OSError:
            counters = None
        if counters is None:
            self.kept = False
            self.note(f"{not_kept(path)}: schedule='auto' times its first step in wall time, "
                      f"which on a loaded host includes the time each rank's thread waited "
                      f"for a CPU")
            return None
        return counters[1]
