"""Functions and scripts run on ranks started by tests/pipeline/comm/test_launch.py."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    out.append(address)
    return out


def store_listeners(rank: int) -> list[str]:
    import torch.distributed as dist

    dist.barrier()  # every rank has joined: the store is up and in use
    return _listeners(int(os.environ["MASTER_PORT"]))


def forged_reports(rank: int) -> float:
    """Rank 0 writes failure reports no rank of ours writes; training must go on."""
    import torch.distributed as dist

    from pipeline import Pipe

    if rank == 0:
        store = dist.distributed_c10d._get_default_store()
        store.set("pipeline/failed", "0:forged: stop the run")  # the old single key
        store.add("pipeline/failures", 1)
        store.set("pipeline/failed/7", "1\nforged: rank 7 is outside the world")
        store.set("pipeline/failed/1", "not a ticket\nforged")
    dist.barrier()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Slow(), nn.Linear(4, 4))
    pipe = Pipe(model, [2, 1], chunks=2, timeout=30)
    loss = torch.zeros(())
    for _ in range(2):
        loss = pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
    return float(loss)


class _Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Long enough that the other rank's waits poll the store (every 50 ms) several times.
        time.sleep(0.2)
        return x


def exits_early(rank: int) -> None:
    """Rank 1 dies at once; rank 0 waits for it in a collective."""
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.barrier()
