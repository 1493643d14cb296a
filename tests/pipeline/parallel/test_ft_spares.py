"""Warm spares: a replica group of one process, spares that wait, take a lost id, and end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.pipeline import ft_train
from tests.pipeline.parallel.test_fault_tolerance import (
    LAUNCH_TIMEOUT,
    TRAIN,
    _assert_same_state,
    _logged_members,
    _replay_step,
    needs_torchft,
)


def _launch(out: Path, *args: str, replicas: int = 2, nproc: int = 1, spares: int = 0,
            heartbeat_timeout: float = 1.0) -> subprocess.CompletedProcess[str]:
    """`python -m pipeline.launch --replicas R --nproc N [--spares K]` of ft_train.py."""
    cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", str(replicas), "--nproc",
           str(nproc), "--max-restarts", "3", "--heartbeat-timeout", str(heartbeat_timeout)]
    cmd += ["--spares", str(spares)] if spares else []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    return subprocess.run([*cmd, TRAIN, str(out), *args], capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT, check=False, env=env)


def _assert_whole_equal_to_replay(out: Path, replicas: tuple[int, ...],
                                  members: list[tuple[int, ...]]) -> None:
    """Groups of one process hold the whole model: each replica's final weights and AdamW
    state equal one process's replay of the logged quorums, bit for bit."""
    model = ft_train.build_model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=ft_train.LR)
    for step, present in enumerate(members):
        _replay_step(model, optimizer, [ft_train.batch(r, step) for r in present])
    finals = {r: torch.load(out / f"final_{r}_0.pt") for r in replicas}
    for r in replicas[1:]:
        _assert_same_state(finals[replicas[0]], finals[r], 0)
    for replica, state in finals.items():
        assert state["committed_steps"] == len(members)
        for i, (name, want) in enumerate(model.state_dict().items()):
            assert torch.equal(state["model"][name], want), (replica, name)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                got = state["optimizer"]["state"][i][key]
                assert torch.equal(got, optimizer.state[params[i]][key]), (replica, name, key)


@needs_torchft
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_replica_groups_of_one_process_heal_and_equal_the_replay(tmp_path: Path) -> None:
    """`--nproc 1`: each replica group is one process holding both stages (it was refused:
    "needs one process per rank"). Replica 1 killed in its forward of step 2 restarts and
    heals; both end bit-identical and equal to the replay of the logged quorums."""
    done = _launch(tmp_path, "4", "--kill", "1:0:2:forward", "--min-step-ms", "20")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "replica group 1 lost rank 0 (killed by SIGKILL)" in done.stderr
    _assert_whole_equal_to_replay(tmp_path, (0, 1), _logged_members(tmp_path))

