"""How long a schedule takes to generate, lower, validate and simulate, per generator.

`python -m benchmarks.schedule_speed` prints one row per registered generator at p = 64,
m = 512 (`--ranks`, `--microbatches`, `--repeats`, `--schedules`): the median seconds of each
phase over the repeats, after one warm-up, each run after a garbage collection. "validate",
"simulate" and "lower" run on a new copy of the schedule each time, so nothing worked out for it
earlier is reused; "lower+validate" is what the runtime does before its first step; "total" is
generate, validate and simulate in a row, timed as one: what a planner pays per candidate.
Pure Python: torch is not imported.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence

from schedules import Schedule, available, get_schedule, info, lower, simulate, validate

__all__ = ["main", "measure"]

_PHASES = ("generate", "validate", "simulate", "total", "lower", "lower+validate")


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        gc.collect()  # each run starts without the last one's garbage
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _median_on_copy(fn: Callable[[Schedule], object], schedule: Schedule,
                    repeats: int) -> float:
    copies = iter([schedule.replace() for _ in range(repeats + 1)])
    # A new object each run, so that nothing worked out for `schedule` before applies.
    return _median_seconds(lambda: fn(next(copies)), repeats)


def measure(name: str, num_ranks: int, num_microbatches: int,
            repeats: int = 5) -> dict[str, float]:
    """Median seconds of each phase for generator `name` (keys: the table's columns)."""
    gen = info(name)
    opts = gen.options_for(stages_per_rank=gen.stages_per_rank)

    def generate() -> Schedule:
        return get_schedule(name, num_ranks, num_microbatches, **opts)

    def total() -> None:
        schedule = generate()
        validate(schedule)
        simulate(schedule)

    schedule = generate()
    return {
        "generate": _median_seconds(generate, repeats),
        "validate": _median_on_copy(validate, schedule, repeats),
        "simulate": _median_on_copy(simulate, schedule, repeats),
        "total": _median_seconds(total, repeats),
        "lower": _median_on_copy(lower, schedule, repeats),
        "lower+validate": _median_on_copy(lambda s: validate(lower(s)), schedule, repeats),
        "actions": float(sum(map(len, schedule.actions))),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.schedule_speed",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--schedules", nargs="*", default=None,
                        help="generator names (default: every registered one)")
    args = parser.parse_args(argv)
    names = args.schedules or list(available())
    print(f"p={args.ranks}, m={args.microbatches}: median seconds of {args.repeats} runs")
    print(f"| schedule | actions | {' | '.join(_PHASES)} |")
    print(f"|---|---|{'---|' * len(_PHASES)}")
    for name in names:
        row = measure(name, args.ranks, args.microbatches, args.repeats)
        cells = " | ".join(f"{row[phase]:.3f}" for phase in _PHASES)
        print(f"| {name} | {int(row['actions'])} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
