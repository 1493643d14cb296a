"""A rank script for the launcher's give-up and stop paths (no torch: it starts in a blink).

    python tests/pipeline/ft_give_up.py OUT [--all-wait | --count N]

Replica group 1's rank 0 SIGKILLs itself at once, at every start (with --all-wait, none
does); every other rank says it is up in OUT/up_<replica>_<rank>, waits (at most a minute)
for the launcher's SIGTERM and records that it got it, in OUT/stopped_<replica>_<rank>.
With --count N, replica group 1's ranks instead join the job's record as a group started
with NUM_REPLICA_GROUPS=N (what `Pipe(fault_tolerance=True)` does first), and every start of
them appends a line to OUT/starts_1.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType


def main(out: str, all_wait: bool, count: str | None) -> None:
    replica, rank = os.environ.get("REPLICA_GROUP_ID", "0"), os.environ["RANK"]
    if replica == "1" and count is not None:
        with open(os.path.join(out, "starts_1"), "a") as f:
            f.write(f"{rank}\n")
        os.environ["NUM_REPLICA_GROUPS"] = count
        from pipeline.replicas.record import JobRecord

        JobRecord.from_environment(1, 30)  # refused: the job runs another count
    elif (replica, rank) == ("1", "0") and not all_wait and count is None:
        os.kill(os.getpid(), signal.SIGKILL)

    def stopped(signum: int, frame: FrameType | None) -> None:
        open(os.path.join(out, f"stopped_{replica}_{rank}"), "w").close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopped)
    open(os.path.join(out, f"up_{replica}_{rank}"), "w").close()
    time.sleep(60)


def stop_launch(args: list[str], out: str, ranks: int) -> tuple[int, str, list[str]]:
    """Run `python -m pipeline.launch ARGS this-script OUT --all-wait`, send the launcher
    SIGTERM once all `ranks` are up; its exit code, its stderr and the ranks that got it."""
    import subprocess
    from pathlib import Path

    cmd = [sys.executable, "-m", "pipeline.launch", *args, __file__, out, "--all-wait"]
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(Path(out).glob("up_*"))) < ranks and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    return launcher.returncode, err, sorted(p.name for p in Path(out).glob("stopped_*"))


if __name__ == "__main__":
    flags = sys.argv[2:]
    main(sys.argv[1], "--all-wait" in flags,
         flags[flags.index("--count") + 1] if "--count" in flags else None)
