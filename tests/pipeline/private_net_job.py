"""A replica job's rank that shows what it can reach: run by tests/pipeline/test_private_net.py
under `python -m pipeline.launch --private-network --replicas 1 --nproc 2`.

    python tests/pipeline/private_net_job.py OUT

Every rank trains 2 fault-tolerant steps; then rank 0 writes to OUT/ports.json the loopback
ports of the job's servers (the lighthouse and the job's record), whether it reaches them
itself, and its network namespace (its inode), and waits (at most 60 s) for OUT/done, so
that the test can try the same ports from outside while they still listen.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from urllib.parse import urlsplit

import torch
from torch import nn

from pipeline import Pipe


def reachable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1], chunks=2,
                fault_tolerance=True, timeout=60)
    optimizer = pipe.fault_tolerant(torch.optim.SGD(pipe.parameters(), lr=0.1))
    for _ in pipe.training_steps(2):
        pipe.step(torch.ones(4, 4), torch.zeros(4, 2), nn.MSELoss())
        optimizer.step()
        optimizer.zero_grad()
    if torch.distributed.get_rank() == 0:
        ports = {"lighthouse": urlsplit(os.environ["TORCHFT_LIGHTHOUSE"]).port,
                 "record": int(os.environ["PIPELINE_FT_RECORD"])}
        report = {"ports": ports, "inside": {k: reachable(p) for k, p in ports.items()},
                  "netns": os.stat("/proc/self/ns/net").st_ino,
                  "committed": pipe.committed_steps}
        with open(os.path.join(out, "ports.tmp"), "w") as f:
            json.dump(report, f)
        os.replace(os.path.join(out, "ports.tmp"), os.path.join(out, "ports.json"))
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "done")) and time.monotonic() < deadline:
            time.sleep(0.1)


if __name__ == "__main__":
    main()
