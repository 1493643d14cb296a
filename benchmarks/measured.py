"""What one group's measurement holds per micro-batch count, and every process's merged as one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.stats import RawEvent
from pipeline.planner import contention

__all__ = ["Measured", "Sample", "merge_ranks"]

Sample = tuple[float, float, list[RawEvent] | None]  # start, end (perf_counter), events


@dataclass
class Measured:
    """What was measured for one micro-batch count (on one process, or merged)."""

    samples: dict[str, list[Sample | None]]  # per variant key, one entry per timed round
    memory: dict[str, dict[str, list[int]]]  # "transport/schedule" -> per-rank peaks
    skipped: dict[str, str]  # variant key -> why it did not run
    # Per variant key and timed round, the CPU seconds its processes used in the step
    # (pipeline/planner/contention.py), and the load average before and after the group's run.
    cpu: dict[str, list[float | None]] = field(default_factory=dict)
    load: tuple[float | None, float | None] = (None, None)
    # The timed rounds as one window: its wall seconds, the CPU seconds of this process (or,
    # merged, of every process of the group) and the machine's busy seconds in it, to tell
    # what other programs took meanwhile (contention.Window); None where not measured.
    window: contention.Window | None = None


def merge_ranks(per_rank: Sequence[dict[int, Measured]]) -> dict[int, Measured]:
    """One Measured per micro-batch count from every process's: a step starts when the first
    process starts it and ends when the last one finishes; events of all ranks together, the
    CPU seconds of all its processes summed, and their windows as one (contention.Window)."""
    merged: dict[int, Measured] = {}
    for m, first in per_rank[0].items():
        samples: dict[str, list[Sample | None]] = {}
        for key, rounds in first.samples.items():
            out: list[Sample | None] = []
            for i in range(len(rounds)):
                present = [t for t in (r[m].samples[key][i] for r in per_rank) if t is not None]
                if not present:
                    out.append(None)
                    continue
                events = [e for t in present for e in (t[2] or [])]
                out.append((min(t[0] for t in present), max(t[1] for t in present),
                            events if any(t[2] is not None for t in present) else None))
            samples[key] = out
        cpu: dict[str, list[float | None]] = {}
        for key, rounds_cpu in first.cpu.items():
            cpu[key] = []
            for i in range(len(rounds_cpu)):
                used = [c for r in per_rank for c in r[m].cpu.get(key, [])[i:i + 1]
                        if c is not None]
                cpu[key].append(sum(used) if used else None)
        memory: dict[str, dict[str, list[int]]] = {}
        for r in per_rank:
            for key, entry in r[m].memory.items():
                into = memory.setdefault(key, {k: [] for k in entry})
                for k, values in entry.items():
                    into[k] += values
        windows = [r[m].window for r in per_rank]
        window = (None if any(w is None for w in windows) else
                  contention.Window.merged([w for w in windows if w is not None]))
        merged[m] = Measured(samples, memory, first.skipped, cpu, window=window)
    return merged
