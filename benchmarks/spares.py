"""Measure kill -> healed with a warm spare (`--spares 1`) and without (`--spares 0`), alternating.

    python -m benchmarks.spares [--runs 3] [--nproc 2] [--kill-at 5] [--point backward]

Each run launches tests/pipeline/ft_train.py as 2 replica groups of `--nproc` ranks under the
launcher's defaults, and SIGKILLs replica 1's rank 1 (rank 0 at `--nproc 1`) at `--point` of
the first step from `--kill-at` on, once the groups trained together and, with a spare, once
the launcher says the spare is ready (a spare that waits, as in a long job). kill -> healed:
from the kill to the first committed step every replica held, read off the ranks' logs. The
runs alternate with and without a spare, so that a change in the host's load falls on both;
the load average is printed with each run (docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["kill_to_healed", "main", "measure"]

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "pipeline" / "ft_train.py"
TIMEOUT_S = 600.0


def kill_to_healed(out: Path, replicas: int = 2) -> float:
    """Seconds from the kill (its marker) to the first committed step every replica held."""
    killed = float(json.loads((out / "killed_0").read_text())["t"])
    together = [float(e["t"]) for path in out.glob("log_*.jsonl")
                for e in map(json.loads, path.open())
                if e["committed"] and e["t"] > killed and len(e["members"]) == replicas]
    return min(together) - killed


def measure(spares: int, nproc: int, kill_at: int, point: str) -> float:
    """One launch with `spares` spares: kill -> healed in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err_path = Path(tmp) / "out", Path(tmp) / "stderr"
        out.mkdir()
        rank = 1 if nproc > 1 else 0
        cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", "2", "--nproc",
               str(nproc), "--spares", str(spares), str(SCRIPT), str(out), str(kill_at),
               "--kill", f"1:{rank}:{kill_at}:{point}", "--kill-after", str(out / "go"),
               "--min-step-ms", "20"]
        with err_path.open("w") as err:
            proc = subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + TIMEOUT_S
            try:
                ready = "spare group 0 ready" if spares else ""
                while ready not in err_path.read_text():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"launch ended before its spare was ready:\n"
                                         f"{err_path.read_text()[-3000:]}")
                    time.sleep(0.2)
                (out / "go").touch()
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if code != 0:
            raise SystemExit(f"launch failed ({code}):\n{err_path.read_text()[-3000:]}")
        return kill_to_healed(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spares", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each (default 3)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per group (default 2)")
    parser.add_argument("--kill-at", type=int, default=5,
                        help="the first step at which the kill may land (default 5)")
    parser.add_argument("--point", default="backward",
                        choices=["forward", "backward", "step", "allreduce", "optimizer"],
                        help="where in that step the rank is killed (default backward)")
    ns = parser.parse_args(argv)
    times: dict[int, list[float]] = {1: [], 0: []}
    for run in range(ns.runs):
        for spares in (1, 0):
            load = os.getloadavg()[0]
            healed = measure(spares, ns.nproc, ns.kill_at, ns.point)
            times[spares].append(healed)
            print(f"run {run} --spares {spares}: kill -> healed {healed:.2f} s (load average "
                  f"{load:.1f} before, {os.getloadavg()[0]:.1f} after)", flush=True)
    for spares, got in times.items():
        print(f"--spares {spares}: median {statistics.median(got):.2f} s, "
              f"{min(got):.2f}-{max(got):.2f} s (n={len(got)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
