"""A rank script for the launcher's give-up and stop paths (no torch: it starts in a blink).

    python tests/pipeline/ft_give_up.py OUT [--all-wait]

Replica group 1's rank 0 SIGKILLs itself at once, at every start (with --all-wait, none
does); every other rank says it is up in OUT/up_<replica>_<rank>, waits (at most a minute)
for the launcher's SIGTERM and records that it got it, in OUT/stopped_<replica>_<rank>.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType


def main(out: str, all_wait: bool) -> None:
    replica, rank = os.environ.get("REPLICA_GROUP_ID", "0"), os.environ["RANK"]
    if (replica, rank) == ("1", "0") and not all_wait:
        os.kill(os.getpid(), signal.SIGKILL)

    def stopped(signum: int, frame: FrameType | None) -> None:
        open(os.path.join(out, f"stopped_{replica}_{rank}"), "w").close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopped)
    open(os.path.join(out, f"up_{replica}_{rank}"), "w").close()
    time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1], "--all-wait" in sys.argv[2:])
