"""`python -m benchmarks.batch_cut`: Python calls and CPU time of a step's batch cut.

    python -m benchmarks.batch_cut --microbatches 8,16 --mode rows,tokens --steps 200

The cut is what a step does to its batch before the program runs: the token micro-batches'
plan (`tokens=`), the split of the input and the target into micro-batches, the loss weights
and the targets moved to the last stage's device (`pipeline/runtime/batches.py`). On a
latency-bound model (two stages of `nn.Linear(32, 32)` over (64, 16, 32) inputs, one process)
the step's cut is taken again `--steps` times, as `Pipe.step` takes it, once under a profiler
(Python calls per step: exact, whatever the load) and once without (CPU time per step, the
median of `--rounds` rounds). Rows mode splits by rows; tokens mode by the rows' lengths.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from torch import nn

from pipeline import Pipe
from pipeline.runtime import batches, weighting
from pipeline.runtime.tokens import cuts

__all__ = ["main", "measure"]

ROWS, LENGTH, WIDTH = 64, 16, 32


def measure(mode: str, m: int, steps: int, rounds: int = 5) -> dict[str, float]:
    """Python calls and CPU microseconds per step of the cut, in `mode` ("rows" or
    "tokens") with `m` micro-batches."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    pipe = Pipe(model, [1, 1], chunks=m, devices=["cpu", "cpu"], checkpoint="never")
    x, y = torch.randn(ROWS, LENGTH, WIDTH), torch.randn(ROWS, LENGTH, WIDTH)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,)) if mode == "tokens" else None
    loss_fn = nn.MSELoss()
    pipe.step(x, y, loss_fn, tokens=lengths)  # warm: the program built, the costs measured
    how = weighting.resolve(loss_fn, None, None)
    program = pipe.program(m)
    pairs = [(x, y)]

    def cut() -> None:
        for _ in range(steps):
            batches.step_inputs(pipe, program, pairs, loss_fn, how, None, 0,
                                cuts(pipe, pairs, lengths, m))

    profile = cProfile.Profile()
    profile.enable()
    cut()
    profile.disable()
    calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    seconds = []
    for _ in range(rounds):
        start = time.process_time()
        cut()
        seconds.append(time.process_time() - start)
    pipe.close()
    return {"calls": calls / steps, "cpu_us": statistics.median(seconds) / steps * 1e6}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_cut",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--microbatches", default="8,16")
    parser.add_argument("--mode", default="rows,tokens")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print("| mode | m | Python calls / step | CPU us / step |")
    print("|---|---|---|---|")
    for mode in args.mode.split(","):
        for m in (int(v) for v in args.microbatches.split(",")):
            r = measure(mode, m, args.steps, args.rounds)
            print(f"| {mode} | {m} | {r['calls']:.0f} | {r['cpu_us']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
