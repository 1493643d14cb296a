"""Whether a timing can be trusted: the CPU time other programs took while it was measured.

A step timed on a machine other programs are using takes longer for reasons that are not the
code's: its threads wait for a CPU. The honest figure is what the others took: the machine's
busy CPU time over the measurement (`/proc/stat`: user, nice, system, irq, softirq and steal,
every CPU; steal is a virtual machine's neighbours) less the CPU time of our own processes
over the same window (`resource.getrusage`: this process and its waited-for children, or the
sum a group of processes reports, `Window.merged`). A measurement is *contended* when the
others took more than `OTHERS_LIMIT` cores on average over it: the reports mark its figure
(`MARK`) and say why (`footnote`), and the JSON keeps the figures (`Reading.to_dict`).

The share of the CPU time our threads got (CPU seconds over wall seconds x threads) is kept,
but judges nothing where `/proc/stat` can be read: a pipeline on few cores waits for its
messages, not for a CPU, and gets a small share on an idle machine. The 1-minute load average
is kept too; it counts our own runnable threads, so it judges nothing there either. Where
`/proc/stat` is missing (not Linux) the old rule stands: under `CPU_SHARE_FLOOR` of the CPU
time the threads could use, or a load average above the cores, is contended.

The clocks are module functions (`wall_clock`, `cpu_seconds`, `load_average`, `proc_stat`)
looked up at each call, so a test can replace them.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["CPU_SHARE_FLOOR", "MARK", "OTHERS_LIMIT", "Meter", "Reading", "Window", "cores",
           "cpu_seconds", "describe", "footnote", "high_load", "load_average", "machine_busy",
           "proc_stat", "thread_seconds", "wall_clock"]

# The fallback rule (no /proc/stat): under half the CPU time the threads could have used.
CPU_SHARE_FLOOR = 0.5
# Other programs took more than a quarter of one CPU on average over the measurement. On the
# 2-core machines the suites run on, a quarter core is an eighth of the machine: where it lands
# on one rank of a pipeline (as slow as its slowest rank) it stretches a step by more than the
# few percent the figures differ by from run to run. An idle machine's own daemons and kernel
# threads take a few hundredths of a core; one busy program takes a whole one.
OTHERS_LIMIT = 0.25
MARK = "*"
# /proc/stat's first line: cpu user nice system idle iowait irq softirq steal guest guest_nice.
# Busy is all but idle and iowait; guest time is counted in user already.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
_STAT = Path("/proc/stat")


def wall_clock() -> float:
    return time.perf_counter()


def cpu_seconds(*, children: bool = False) -> float:
    """User + system seconds of this process's threads (and of its waited-for children)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += kids.ru_utime + kids.ru_stime
    return total


def thread_seconds() -> float:
    """CPU seconds of the calling thread alone (CLOCK_THREAD_CPUTIME_ID): work that runs on
    this one thread costs the same whether other programs share its core or not, where its
    wall time grows by the time it waited for a CPU."""
    return time.thread_time()


def proc_stat() -> str | None:
    """The kernel's CPU counters (`/proc/stat`); None where there are none (not Linux). The
    kernel writes the file, no user can: it is read as it is."""
    try:
        return _STAT.read_text()
    except OSError:
        return None


def machine_busy() -> float | None:
    """CPU seconds the whole machine has been busy since boot, every CPU (user, nice, system,
    irq, softirq, steal); None where `proc_stat` has none. Counted in clock ticks (10 ms): a
    window of a second or more reads it to a few percent."""
    text = proc_stat()
    if text is None:
        return None
    fields = text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu" or not all(f.isdigit() for f in fields[1:]):
        return None  # not the layout this reads: the fallback rule judges
    values = [int(f) for f in fields[1:]]
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return sum(values[i] for i in _BUSY_FIELDS if i < len(values)) / hz


def load_average() -> float | None:
    """The 1-minute load average (runnable threads, machine-wide); None where unknown."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def cores() -> int:
    """The machine's logical CPUs, which the load average counts against."""
    return os.cpu_count() or 1


def high_load() -> str:
    """Why the machine is too busy to time anything by the wall clock ('' when it is not):
    the 1-minute load average above its cores."""
    load, n = load_average(), cores()
    if load is None or load <= n:
        return ""
    return f"the load average is {load:.1f} on {n} cores"


@dataclass(frozen=True)
class Window:
    """A stretch of time: its wall seconds, the CPU seconds our processes used in it, and the
    machine's busy CPU seconds in it (`machine_busy`; None where unknown)."""

    wall_s: float
    ours_s: float
    machine_s: float | None

    @property
    def others_s(self) -> float | None:
        """CPU seconds other programs took (steal included); ticks make a short window's
        figure a little off either way, so it can come out slightly below zero."""
        return None if self.machine_s is None else self.machine_s - self.ours_s

    @classmethod
    def merged(cls, windows: Sequence[Window]) -> Window:
        """Several processes' windows over one stretch of time as one: the first's wall and
        machine seconds (every process reads the same machine), their own CPU seconds summed."""
        return cls(windows[0].wall_s, sum(w.ours_s for w in windows), windows[0].machine_s)


@dataclass(frozen=True)
class Reading:
    """What one measurement got: wall and CPU seconds, the threads it could keep busy (and
    for what share of the time: a pipeline's ranks sit out its bubble), the load average
    before and after it on this many cores, and the CPU seconds other programs took over a
    window around it of `others_wall_s` (None where unknown: the fallback rule judges)."""

    wall_s: float
    cpu_s: float
    threads: int
    cores: int
    load_before: float | None = None
    load_after: float | None = None
    busy: float = 1.0  # of the wall time, the share the threads have work (1 - bubble)
    others_cpu_s: float | None = None
    others_wall_s: float | None = None

    @property
    def cpu_share(self) -> float | None:
        """CPU seconds / (wall seconds x threads x busy): near 1 (or above, where waiting
        threads spin) when the threads had their CPUs and had no message to wait for."""
        if self.wall_s <= 0 or self.threads < 1 or self.busy <= 0:
            return None
        return self.cpu_s / (self.wall_s * self.threads * self.busy)

    @property
    def others_cores(self) -> float | None:
        """The CPUs other programs took on average over the window (0.5: half of one CPU)."""
        if self.others_cpu_s is None or not self.others_wall_s or self.others_wall_s <= 0:
            return None
        return self.others_cpu_s / self.others_wall_s

    @property
    def load(self) -> float | None:
        seen = [v for v in (self.load_before, self.load_after) if v is not None]
        return max(seen) if seen else None

    def with_window(self, window: Window | None) -> Reading:
        """This reading with what other programs took over `window`."""
        if window is None or window.others_s is None:
            return self
        return Reading(self.wall_s, self.cpu_s, self.threads, self.cores, self.load_before,
                       self.load_after, self.busy, window.others_s, window.wall_s)

    def reasons(self, floor: float = CPU_SHARE_FLOOR) -> list[str]:
        """Why the measurement is contended, in words; empty when it is not."""
        others = self.others_cores
        if others is not None:
            if others <= OTHERS_LIMIT:
                return []
            return [f"other programs took {others:.2f} CPUs on average "
                    f"({self.others_cpu_s:.1f} s of CPU in {self.others_wall_s:.1f} s; "
                    f"over {OTHERS_LIMIT:g} is contended)"]
        out = []
        share = self.cpu_share
        if share is not None and share < floor:
            # One decimal: 49.6% must not read as 50% beside "under 50%".
            out.append(f"it got {share:.1%} of the CPU time its {self.threads} thread"
                       f"{'s' if self.threads > 1 else ''} could use (under {floor:.0%})")
        if self.load is not None and self.load > self.cores:
            out.append(f"the load average was {self.load:.1f} on {self.cores} cores")
        return out

    def contended(self, floor: float = CPU_SHARE_FLOOR) -> bool:
        return bool(self.reasons(floor))

    def to_dict(self, floor: float = CPU_SHARE_FLOOR) -> dict[str, Any]:
        share, others = self.cpu_share, self.others_cores
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "threads": self.threads,
                "busy": self.busy, "cpu_share": None if share is None else round(share, 4),
                "cores": self.cores, "load_before": self.load_before,
                "load_after": self.load_after, "cpu_share_floor": floor,
                "others_cpu_s": self.others_cpu_s, "others_wall_s": self.others_wall_s,
                "others_cores": None if others is None else round(others, 4),
                "others_limit": OTHERS_LIMIT,
                "rule": "cpu_share" if others is None else "others",
                "contended": self.contended(floor), "reasons": self.reasons(floor)}

    @classmethod
    def total(cls, readings: Iterable[Reading]) -> Reading | None:
        """Several measurements of one thing as one: wall, CPU and others' seconds summed (the
        others' only where every one has them), the highest load seen before and after any."""
        items = list(readings)
        if not items:
            return None
        before = [r.load_before for r in items if r.load_before is not None]
        after = [r.load_after for r in items if r.load_after is not None]
        known = all(r.others_cpu_s is not None and r.others_wall_s is not None for r in items)
        return cls(wall_s=sum(r.wall_s for r in items), cpu_s=sum(r.cpu_s for r in items),
                   threads=max(r.threads for r in items), cores=items[0].cores,
                   load_before=max(before) if before else None,
                   load_after=max(after) if after else None, busy=items[0].busy,
                   others_cpu_s=sum(r.others_cpu_s or 0.0 for r in items) if known else None,
                   others_wall_s=sum(r.others_wall_s or 0.0 for r in items) if known else None)


class Meter:
    """`with Meter(threads) as m: ...` then `m.reading`: the block's wall and CPU seconds
    (this process's, and its children's with `children=True`), the load around it, and what
    other programs took meanwhile: the machine's busy time less this process's and its
    waited-for children's (a child still running at the end is not counted: wait for it)."""

    def __init__(self, threads: int, *, busy: float = 1.0, children: bool = False,
                 load: bool = True) -> None:
        self.threads, self.busy, self.children, self.load = threads, busy, children, load
        self.reading: Reading | None = None

    def __enter__(self) -> Meter:
        self._load = load_average() if self.load else None
        self._machine = machine_busy()
        self._tree = cpu_seconds(children=True)
        self._cpu = self._tree if self.children else cpu_seconds()
        self._wall = wall_clock()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        wall = wall_clock() - self._wall
        tree = cpu_seconds(children=True)
        cpu = (tree if self.children else cpu_seconds()) - self._cpu
        machine = machine_busy()
        window = Window(wall, tree - self._tree, None if machine is None or self._machine is None
                        else machine - self._machine)
        self.reading = Reading(wall, cpu, self.threads, cores(), self._load,
                               load_average() if self.load else None,
                               self.busy).with_window(window)


def footnote(floor: float = CPU_SHARE_FLOOR) -> str:
    """The sentence under a table whose figures carry `MARK`."""
    return (f"{MARK} measured under contention: other programs took more than "
            f"{OTHERS_LIMIT:g} CPUs on average while it was measured (the machine's busy CPU "
            f"time from /proc/stat, a virtual machine's stolen time included, less this run's "
            f"own processes'). Where /proc/stat is missing (not Linux): the run got under "
            f"{floor:.0%} of the CPU time its threads could use (CPU time / (wall time x "
            f"threads x the share of the time they have work)), or the 1-minute load average "
            f"was above the machine's {cores()} cores. The figure is not reliable; rerun on an "
            f"idle machine.")


def describe(readings: Mapping[str, Reading]) -> list[str]:
    """Lines for a report beside named figures: the load and each one's CPU share, then, if
    any was contended, the footnote and why each was."""
    first = next(iter(readings.values()), None)
    if first is None:
        return []
    load = "unknown" if first.load is None else f"{first.load:.1f}"
    lines = [f"load average {load} on {first.cores} cores; share of the CPU time the threads "
             f"could use: "
             + ", ".join(f"{name} {'-' if r.cpu_share is None else f'{r.cpu_share:.0%}'}"
                         for name, r in readings.items())]
    flagged = {name: r.reasons() for name, r in readings.items() if r.contended()}
    if flagged:
        lines.append(footnote())
        lines += [f"  {name}: {'; '.join(why)}" for name, why in flagged.items()]
    return lines
