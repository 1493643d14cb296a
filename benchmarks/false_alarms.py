"""Count false stall alarms: replica jobs launched one after another beside spinning processes.

    python -m benchmarks.false_alarms [--launches 20] [--spinners 16] [--nice 19] [--steps 20]

Each launch runs tests/pipeline/ft_train.py as 2 replica groups of 2 ranks under the launcher's
defaults, with nothing killed: every rank is live, so a rank the launcher ends for "no beat for"
its heartbeat timeout (a restart) is a false alarm. `--spinners` processes spin on the CPUs the
whole time (16 on 2 cores: a load of 8 per core); the launches and the spinners run at one
niceness (`--nice`), so the job gets a spinner's share of the CPUs whatever else the host runs.
Per launch it prints the exit status, the seconds, the load average at its start and end, and
the alarms and restarts seen in the launcher's stderr (docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["launch", "main"]

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "pipeline" / "ft_train.py"
TIMEOUT_S = 900.0
# A spinner stops when its parent (this process) is gone, however this process ends.
_SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def launch(steps: int, nice: int) -> dict[str, Any]:
    """One 2 x 2 launch of `steps` steps: its exit, seconds, load and false alarms."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", "2", "--nproc", "2",
               str(SCRIPT), tmp, str(steps)]
        start, load = time.monotonic(), os.getloadavg()[0]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                                  preexec_fn=lambda: os.nice(nice))
            rc: int | str = done.returncode
            err = done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, err = "timeout", exc.stderr.decode() if isinstance(exc.stderr, bytes) else ""
    alarms = [line for line in err.splitlines() if "no beat for" in line]
    return {"rc": rc, "s": round(time.monotonic() - start, 1), "load_start": round(load, 1),
            "load_end": round(os.getloadavg()[0], 1), "alarms": len(alarms),
            "restarts": err.count("restarting it"), "alarm_lines": alarms}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.false_alarms",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=20, help="launches (default 20)")
    parser.add_argument("--spinners", type=int, default=16,
                        help="spinning processes beside them (default 16)")
    parser.add_argument("--nice", type=int, default=19,
                        help="niceness of the spinners and the launches (default 19)")
    parser.add_argument("--steps", type=int, default=20, help="steps a launch trains")
    args = parser.parse_args(argv)
    if args.launches < 1 or args.spinners < 0 or not 0 <= args.nice <= 19 or args.steps < 1:
        parser.error(f"--launches and --steps must be >= 1, --spinners >= 0 and --nice in "
                     f"[0, 19] (got {args.launches}, {args.steps}, {args.spinners}, "
                     f"{args.nice})")
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                                 preexec_fn=lambda: os.nice(args.nice))
                for _ in range(args.spinners)]
    total = {"alarms": 0, "restarts": 0, "failed": 0}
    try:
        for i in range(args.launches):
            row = launch(args.steps, args.nice)
            print(json.dumps({"launch": i, **row}), flush=True)
            total["alarms"] += row["alarms"]
            total["restarts"] += row["restarts"]
            total["failed"] += row["rc"] != 0
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()
    print(f"{args.launches} launches beside {args.spinners} spinners at nice {args.nice}: "
          f"{total['alarms']} false alarms, {total['restarts']} restarts, {total['failed']} "
          f"launches not exiting 0")
    return 1 if total["alarms"] or total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
