"""Whether a timing can be trusted: the load, and the CPU time a run got beside its wall time.

A step timed on a machine other programs are using takes longer for reasons that are not the
code's: its threads wait for a CPU. Two figures show it. The CPU time the run's processes got
(user + system, every thread, from `resource.getrusage`) over its wall time times the threads
it could keep busy: a run that had its cores gets most of that product, one that waited for
them gets a fraction. And the 1-minute load average (`os.getloadavg`) beside the core count:
more runnable threads than cores means someone waited. A measurement below `CPU_SHARE_FLOOR`,
or under a load above the cores, is *contended*: the reports mark its figure (`MARK`) and say
why (`footnote`), and the JSON keeps the figures (`Reading.to_dict`).

The clocks are module functions (`wall_clock`, `cpu_seconds`, `load_average`) looked up at
each call, so a test can replace them.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = ["CPU_SHARE_FLOOR", "MARK", "Meter", "Reading", "cores", "cpu_seconds", "describe",
           "footnote", "high_load", "load_average", "thread_seconds", "wall_clock"]

# Under half the CPU time the threads could have used: half the run waited for a CPU (or
# slept). The pipelines' own idle time (their bubbles) stays well above it on an idle
# machine, as they spin while they wait for a message.
CPU_SHARE_FLOOR = 0.5
MARK = "*"


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
class Reading:
    """What one measurement got: wall and CPU seconds, the threads it could keep busy (and
    for what share of the time: a pipeline's ranks sit out its bubble), and the load average
    before and after it on this many cores."""

    wall_s: float
    cpu_s: float
    threads: int
    cores: int
    load_before: float | None = None
    load_after: float | None = None
    busy: float = 1.0  # of the wall time, the share the threads have work (1 - bubble)

    @property
    def cpu_share(self) -> float | None:
        """CPU seconds / (wall seconds x threads x busy): near 1 (or above, where waiting
        threads spin) when the threads had their CPUs."""
        if self.wall_s <= 0 or self.threads < 1 or self.busy <= 0:
            return None
        return self.cpu_s / (self.wall_s * self.threads * self.busy)

    @property
    def load(self) -> float | None:
        seen = [v for v in (self.load_before, self.load_after) if v is not None]
        return max(seen) if seen else None

    def reasons(self, floor: float = CPU_SHARE_FLOOR) -> list[str]:
        """Why the measurement is contended, in words; empty when it is not."""
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
        share = self.cpu_share
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "threads": self.threads,
                "busy": self.busy, "cpu_share": None if share is None else round(share, 4),
                "cores": self.cores, "load_before": self.load_before,
                "load_after": self.load_after, "cpu_share_floor": floor,
                "contended": self.contended(floor), "reasons": self.reasons(floor)}

    @classmethod
    def total(cls, readings: Iterable[Reading]) -> Reading | None:
        """Several measurements of one thing as one: wall and CPU seconds summed, the highest
        load seen before and after any of them."""
        items = list(readings)
        if not items:
            return None
        before = [r.load_before for r in items if r.load_before is not None]
        after = [r.load_after for r in items if r.load_after is not None]
        return cls(wall_s=sum(r.wall_s for r in items), cpu_s=sum(r.cpu_s for r in items),
                   threads=max(r.threads for r in items), cores=items[0].cores,
                   load_before=max(before) if before else None,
                   load_after=max(after) if after else None, busy=items[0].busy)


class Meter:
    """`with Meter(threads) as m: ...` then `m.reading`: the block's wall and CPU seconds
    (this process's, and its children's with `children=True`) and the load around it."""

    def __init__(self, threads: int, *, busy: float = 1.0, children: bool = False,
                 load: bool = True) -> None:
        self.threads, self.busy, self.children, self.load = threads, busy, children, load
        self.reading: Reading | None = None

    def __enter__(self) -> Meter:
        self._load = load_average() if self.load else None
        self._cpu = cpu_seconds(children=self.children)
        self._wall = wall_clock()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        wall = wall_clock() - self._wall
        cpu = cpu_seconds(children=self.children) - self._cpu
        self.reading = Reading(wall, cpu, self.threads, cores(), self._load,
                               load_average() if self.load else None, self.busy)


def footnote(floor: float = CPU_SHARE_FLOOR) -> str:
    """The sentence under a table whose figures carry `MARK`."""
    return (f"{MARK} measured under contention: the run got under {floor:.0%} of the CPU time "
            f"its threads could use (CPU time / (wall time x threads x the share of the time "
            f"they have work)), or the 1-minute load "
            f"average was above the machine's {cores()} cores. Other programs took the CPUs: "
            f"the figure is not reliable; rerun on an idle machine.")


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
