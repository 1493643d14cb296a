"""How long a local process's threads waited for a CPU: tells a starved rank from a stalled one.

Linux accounts, per thread, the time it spent runnable but not running, waiting on a CPU's run
queue (`/proc/<pid>/task/<tid>/schedstat`, its second field, in nanoseconds; kept where the
kernel has CONFIG_SCHED_INFO). A rank held off the CPU by other programs is runnable: the
thread that holds its GIL, or its beating thread, waits there. A stalled rank (SIGSTOPped,
frozen, hung in a call that holds the GIL) is not runnable and waits on no run queue; only
threads that wake now and then to ask for a held GIL (every 5 ms) add the short waits of those
wakes. The kernel adds a wait to that field only once the thread runs again, so a thread seen
runnable (`R` in `/proc/<pid>/task/<tid>/stat`) with its counters unchanged from one read to
the next is counted as waiting since the first of them.

The kernel writes these files and no user can, so they are read as they are, not through the
file gate.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.schedstat import PROC, not_kept, parse

__all__ = ["PROC", "RunQueue", "Thread", "Waits", "Window", "stderr_note"]


@dataclass(frozen=True)
class Thread:
    """One thread's counters: nanoseconds run, nanoseconds waited on a run queue (both so
    far), and whether it is runnable now."""

    ran: int
    waited: int
    runnable: bool


Waits = dict[int, Thread]  # thread id: its counters


def stderr_note(text: str) -> None:
    print(f"pipeline.launch: {text}", file=sys.stderr, flush=True)


class RunQueue:
    """Reads the run-queue waits of processes on this host from `proc` (a directory laid out
    as /proc; a test passes its own). Where the kernel keeps none, `note` is told once, and
    every read answers None: the plain timeout then judges."""

    def __init__(self, proc: str | os.PathLike[str] = PROC,
                 note: Callable[[str], None] = stderr_note) -> None:
        self.proc, self.note = Path(proc), note
        self.kept = True  # False once a local process's threads were found without schedstat

    def waits(self, pid: int) -> Waits | None:
        """Each thread of `pid` and its counters; None where `pid` has no entry (not a
        process of this host, or gone) or the kernel keeps no waits."""
        if not self.kept:
            return None
        task = self.proc / str(pid) / "task"
        try:
            tids = [int(name) for name in os.listdir(task) if name.isdigit()]
        except OSError:  # no such process here: a rank on another host, or one that ended
            return None
        out: Waits = {}
        for tid in tids:
            try:
                counters = parse((task / str(tid) / "schedstat").read_text())
                stat = (task / str(tid) / "stat").read_text()
            except FileNotFoundError:
                if (task / str(tid)).is_dir() and not (task / str(tid) / "schedstat").exists():
                    self._not_kept(task / str(tid) / "schedstat")
                    return None
                continue  # the thread ended between the listing and the read
            except OSError:
                continue
            if counters is None:
                self._not_kept(task / str(tid) / "schedstat")
                return None
            # The state follows the command's name, which is in parentheses and may hold any.
            state = stat[stat.rfind(")") + 1:].split()[:1]
            out[tid] = Thread(counters[0], counters[1], state == ["R"])
        return out

    def _not_kept(self, path: Path) -> None:
        self.kept = False
        self.note(f"{not_kept(path)}: a rank held off the "
                  f"CPU for the heartbeat timeout is taken for stalled as a stopped one is; "
                  f"on a loaded host raise --heartbeat-timeout")


class Window:
    """One process's run-queue waits from `now` on, read again at each look (`waited`)."""

    def __init__(self, first: Waits | None, now: float) -> None:
        self.first, self.last = first, first
        # Since when each thread has been seen runnable with the same counters: waiting.
        self.runnable_since = {tid: now for tid, t in (first or {}).items() if t.runnable}

    def waited(self, waits: Waits | None, now: float) -> float:
        """Seconds: the most that any one thread waited for a CPU in the window, up to `now`
        (0 where either read is unknown). The most, not the sum: a rank's threads wait side
        by side, and the one that waited longest (the GIL's holder, or the beating thread) is
        what held its beats up. A thread born in the window waited all its wait in it."""
        if self.first is None or waits is None:
            return 0.0
        last, self.last = self.last or {}, waits
        most = 0.0
        for tid, t in waits.items():
            before = last.get(tid)
            if not t.runnable:
                self.runnable_since.pop(tid, None)
            elif before is None or (before.ran, before.waited) != (t.ran, t.waited):
                self.runnable_since[tid] = now  # it ran since: its wait so far is counted
            first = self.first.get(tid)
            done = max(t.waited - (first.waited if first else 0), 0) / 1e9
            most = max(most, done + now - self.runnable_since.get(tid, now))
        return most
