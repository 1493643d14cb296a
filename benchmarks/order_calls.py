"""`python -m benchmarks.order_calls`: calls per CPU second of the token cut's run order choice.

    python -m benchmarks.order_calls --microbatches 8,16

Under `tokens=` a step picks the order its micro-batches run in by simulating its program for
three candidate orders (`pipeline.runtime.tokens.order`). On the program a two-stage Pipe runs
(1f1b, lowered, no syncs; `--schedule`, `--ranks`), with micro-batch costs drawn once from a
fixed seed, this counts `order` calls and `schedules.simulate` calls under those costs per CPU
second: the median of `--rounds` rounds of `--seconds` each, after one warm-up call. It uses
only what both sides of a change have, so that another checkout can be measured by running
this file with PYTHONPATH at that checkout's root.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import schedules
from pipeline.runtime.tokens import order

__all__ = ["main", "measure"]


def _rate(fn: Callable[[], object], rounds: int, seconds: float) -> float:
    fn()  # warm: the program's graph built where it is kept
    rates = []
    for _ in range(rounds):
        calls, start = 0, time.process_time()
        while (spent := time.process_time() - start) < seconds:
            fn()
            calls += 1
        rates.append(calls / spent)
    return statistics.median(rates)


def measure(schedule: str, ranks: int, m: int, rounds: int = 5,
            seconds: float = 0.5) -> dict[str, float]:
    """`order` and `simulate` calls per CPU second on `schedule`'s program at `ranks` x `m`."""
    program = schedules.validate(schedules.program(schedules.get_schedule(schedule, ranks, m),
                                                   schedules.Syncs()))
    rng = random.Random(0)
    costs = [float(rng.randint(1, 64)) for _ in range(m)]  # rows x trimmed length
    scaled = schedules.Costs(microbatch=[c / max(costs) for c in costs])
    return {"order": _rate(lambda: order(costs, program), rounds, seconds),
            "simulate": _rate(lambda: schedules.simulate(program, scaled), rounds, seconds)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.order_calls",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--microbatches", default="8,16")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args(argv)
    print("| m | order calls / s | simulate calls / s |")
    print("|---|---|---|")
    for m in (int(v) for v in args.microbatches.split(",")):
        r = measure(args.schedule, args.ranks, m, args.rounds, args.seconds)
        print(f"| {m} | {r['order']:.0f} | {r['simulate']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
