"""A fault-tolerant training script: run by tests/pipeline/parallel/test_fault_tolerance.py
under `python -m pipeline.launch --replicas R --nproc 2`, and by the docs' measurement.

    python tests/pipeline/ft_train.py OUT STEPS [KILL]

KILL is "replica:rank:step:point" (point: forward, backward, step): that rank SIGKILLs itself
at that point of the first step it runs at or after committed step `step`, once per job (a
file in OUT marks it done). Each rank writes its final state to OUT/final_<replica>_<rank>.pt
one JSON line per step to OUT/log_<replica>_<rank>.jsonl, and per start the first
quorum's time (a heal's, for a restarted group) to OUT/start_<replica>_<rank>.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from torch import nn

from pipeline import Pipe

WIDTH = 16


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one replica's share of one committed step: the same on every retry."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def _kill_once(out: str) -> None:
    try:  # the first rank to get here kills itself; a restarted group never does again
        fd = os.open(os.path.join(out, "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, repr(time.time()).encode())  # when: for the measurements
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, steps: int, kill: str | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    pipe = Pipe(model, balance=[2, 2], chunks=2, fault_tolerance=True, timeout=60)
    started = time.time()
    optimizer = pipe.fault_tolerant(torch.optim.AdamW(pipe.parameters(), lr=0.01))
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"start_{pipe.replica_id}_{rank}.jsonl"), "a") as f:
        # The first quorum (a heal, for a group that starts late or again) ran in the wrap.
        f.write(json.dumps({"built": started, "quorum_s": time.time() - started,
                            "step": pipe.committed_steps}) + "\n")
    where = ""
    if kill is not None:
        replica, kill_rank, kill_step, where = kill.split(":")
        if (int(replica), int(kill_rank)) != (pipe.replica_id, rank):
            where = ""
    armed = [False]
    if where in ("forward", "backward"):
        layer = next(iter(pipe.partitions[rank]))

        def forward_hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            if armed[0] and where == "forward":
                _kill_once(out)
            if armed[0] and where == "backward" and output.requires_grad:
                output.register_hook(lambda g: _kill_once(out))

        layer.register_forward_hook(forward_hook)
    log = open(os.path.join(out, f"log_{pipe.replica_id}_{rank}.jsonl"), "a")  # noqa: SIM115
    # Train to `steps`, and on until a step every replica took part in is committed: a group
    # that was restarted catches up (heals) before the others stop, so all end at one step.
    everyone = False
    while pipe.committed_steps < steps or not everyone:
        step = pipe.committed_steps
        armed[0] = bool(where) and step >= int(kill_step)
        x, y = batch(pipe.replica_id, step)
        loss = pipe.step(x, y, nn.MSELoss())
        if armed[0] and where == "step":
            _kill_once(out)
        optimizer.step()
        optimizer.zero_grad()
        everyone = pipe.committed_steps > step and pipe.num_participants == pipe.num_replicas
        log.write(json.dumps({"t": time.time(), "step": step, "loss": loss.item(),
                              "committed": pipe.committed_steps > step,
                              "participants": pipe.num_participants}) + "\n")
        log.flush()
    torch.save({"model": pipe.state_dict(), "optimizer": optimizer.state_dict(),
                "committed_steps": pipe.committed_steps},
               os.path.join(out, f"final_{pipe.replica_id}_{rank}.pt"))
    pipe.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
