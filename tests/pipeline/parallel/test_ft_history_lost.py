"""Replica jobs that lose what they cannot do without end at once, saying what was lost: the
group a heal came from (mid-heal), every group holding the history, the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

REPO = Path(__file__).parents[3]
TRAIN = str(REPO / "tests" / "pipeline" / "ft_train.py")
# The job ends well within this once its history is lost (a rerun loop ran until killed).
END_BOUND_S = 240


def _launch(out: Path, *args: str, timeout: float = END_BOUND_S
            ) -> subprocess.CompletedProcess[str]:
    """The launcher's defaults (a 5 s heartbeat timeout), 2 groups of 2 ranks (a half heal
    needs a group of two ranks healing from two sources)."""
    cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", "2", "--nproc", "2",
           TRAIN, str(out), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          env=env)


def _entries(out: Path) -> dict[tuple[int, int], list[dict[str, Any]]]:
    logs = {}
    for path in out.glob("log_*.jsonl"):
        replica, rank = map(int, path.stem.split("_")[1:])
        logs[replica, rank] = [json.loads(line) for line in path.open()]
    return logs


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(END_BOUND_S + 60)
def test_the_heal_source_lost_mid_heal_ends_the_job_without_a_start_over(
        tmp_path: Path, busy: None) -> None:
    """Replica 1 is lost at step 1 and restarted; its rank 0 heals from replica 0, but the
    rank of replica 0 its rank 1 heals from is killed first. Rank 1's heal is refused: the
    group's heal is undone (its ranks hold two steps), and no live group holds the history.
    The job ends with exit 1 at once, naming what was lost and how to resume; replica 0 is
    never started again and no step is committed a second time (the launcher restarted
    replica 0, both groups committed steps 0.. again from the initial weights, then retried
    one step forever)."""
    done = _launch(tmp_path, "4", "--kill", "1:0:1:forward,0:1:0:source",
                   "--min-step-ms", "20")
    ended = time.time()
    assert done.returncode == 1, done.stderr[-4000:]
    assert "restarting it (restart 1" in done.stderr  # replica 1, after the first kill
    assert "replica group 0 lost rank 1" in done.stderr, done.stderr[-4000:]
    assert "replica group 0 lost rank 1 (killed by SIGKILL); restarting" not in done.stderr
    assert "no live group holds the job's history" in done.stderr, done.stderr[-4000:]
    assert "pipe.save / pipe.load" in done.stderr
    assert "does not hold the job's history" not in done.stderr
    source = json.loads((tmp_path / "killed_1").read_text())
    for (replica, rank), entries in _entries(tmp_path).items():
        steps = [e["step"] for e in entries if e["committed"]]
        # Each rank's committed steps in order, none taken twice: no start-over.
        assert steps == sorted(set(steps)), (replica, rank, steps)
        late = [e for e in entries if e["t"] > source["t"] and e["committed"]]
        assert not late, (replica, rank, late)  # nothing committed after the source's loss
    # From the source's loss to the launcher's exit: 4.5 s measured on an idle host, 65 s
    # beside one spinning process per core (the half-healed group's exit and teardown).
    assert ended - source["t"] < 90, ended - source["t"]


# Run apart from pytest: it adopts the ranks the killed launcher leaves (a subreaper), to
# wait for them and read their exit codes. argv: out, the train script.
_ADOPT = r"""
import ctypes, json, os, signal, subprocess, sys, time
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
out, train = sys.argv[1], sys.argv[2]
with open(os.path.join(out, "launch.err"), "w") as err:
    launcher = subprocess.Popen([sys.executable, "-m", "pipeline.launch", "--replicas", "1",
                                 "--nproc", "2", train, out, "100000", "--min-step-ms", "100"],
                                stderr=err)
def committed():
    for name in os.listdir(out):
        if name.startswith("log_") and '"committed": true' in open(os.path.join(out, name)).read():
            return True
    return False
deadline = time.monotonic() + 120
while time.monotonic() < deadline and launcher.poll() is None and not committed():
    time.sleep(0.1)
os.kill(launcher.pid, signal.SIGKILL)
launcher.wait()
killed = time.monotonic()
ranks = {}
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    ranks[pid] = [os.waitstatus_to_exitcode(status), time.monotonic() - killed]
print(json.dumps({"launcher": launcher.pid, "ranks": ranks}))
"""


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(END_BOUND_S + 60)
def test_ranks_of_a_lost_launcher_end_naming_it(tmp_path: Path, busy: None) -> None:
    """The launcher SIGKILLed while its group trains (one group of 2 ranks: group rank 0
    talks to the lighthouse and the record, rank 1 to the record alone; a second group would
    add nothing but start-up time): every rank notices within the
    liveness timeout (5 s by default; 20 s allowed on a loaded host) and exits 75, naming the
    coordinator it lost (address, the launcher's pid) and where its last committed state is
    (no save in this run). Each rank died 71-77 s later of a bare ConnectionResetError from
    the record's claim, naming nothing."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _ADOPT, str(tmp_path), TRAIN],
                          capture_output=True, text=True, timeout=END_BOUND_S, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    stderr = (tmp_path / "launch.err").read_text()
    assert len(report["ranks"]) == 2, (report, stderr[-3000:])
    for code, after in report["ranks"].values():
        assert code == 75 and after < 20, (report, stderr[-3000:])
    lost = [line for line in stderr.splitlines() if "the job's coordinator at 127.0.0.1:" in line]
    assert len(lost) == 2, stderr[-3000:]
    for line in lost:
        assert f"kept by the launcher (pid {report['launcher']})" in line, line
        assert "it saved none in this run (pipe.save)" in line, line
        assert "committed steps in memory, now lost" in line, line
