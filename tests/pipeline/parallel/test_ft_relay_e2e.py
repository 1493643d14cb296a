"""A real replica job whose coordinator connection goes through a relay run by another local
user (a separate process of uid 65534): it reads nothing of what the job sends, and a byte it
changes in an answer breaks the connection, never the training. Before the job's TLS, another
user who wrote the groups' manager address into their rendezvous stores relayed them in 4 of
4 runs, and answers flipped on the way made groups train apart or wedge."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.other_user import other_user, start_as_other
from tests.pipeline.parallel.conftest import JOB_PEM
from tests.pipeline.parallel.relay_process import RELAY_CODE

pytest.importorskip("torchft")

from pipeline.replicas.environment import LIGHTHOUSE_ENV, NUM_REPLICAS_ENV, REPLICA_ID_ENV
from pipeline.replicas.record import RECORD_ENV
from pipeline.replicas.tls import CERT_ENV

REPO = Path(__file__).parents[3]
TRAIN = str(REPO / "tests" / "pipeline" / "ft_train.py")
STEPS = 8
JOB_BOUND_S = 150  # the job ends by then, whatever the relay does: a hang fails here
# How long a group that reached STEPS waits for a lost group to come back (training_steps'
# deadline, 300 s by default): groups started by hand have no launcher to restart a lost one,
# so a survivor of "once" holds at STEPS until then and ends with PipelineError.
DEADLINE_S = 20
# From the first changed byte to every group's exit: a broken connection ends its rank at
# once (its launcher then gives the group's others 15 s); 9 s measured on 2 loaded cores.
TAMPER_BOUND_S = 60
# Plaintext the job sends and receives on the coordinator's connection: the record's keys
# (each step's claim, each group's count, the groups' count), the lighthouse's operations
# and the members it returns, the wire's own JSON.
CLEAR = (b"commit/", b"group/", b"replicas", b"quorum", b"heartbeat", b"replica_id",
         b"store_address", b'"op"', b"compare_set")


def _start_coordinator(env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    """`python -m pipeline.replica_launch --record`, and the port it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.replica_launch", "--record"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line and line[0] == "export", (line, proc.stderr.read() if proc.stderr else "")
    exports = dict(word.split("=", 1) for word in line[1:])
    return proc, int(exports[RECORD_ENV])


def _start_group(replica: int, relay_port: int, out: Path, env: dict[str, str]
                 ) -> subprocess.Popen[str]:
    """One replica group of 2 ranks, started by hand, pointed at the relay's port as the
    coordinator's (the lighthouse and the record share it)."""
    group_env = {**env, LIGHTHOUSE_ENV: f"http://127.0.0.1:{relay_port}",
                 RECORD_ENV: str(relay_port), REPLICA_ID_ENV: str(replica),
                 NUM_REPLICAS_ENV: "2"}
    # Its output to a file: a process a rank left behind holding a pipe would hold the
    # reader past the group's own exit.
    with open(out / f"group_{replica}.out", "w") as output:
        return subprocess.Popen([sys.executable, "-m", "pipeline.launch", "--nproc", "2",
                                 TRAIN, str(out), str(STEPS), "--min-step-ms", "100",
                                 "--deadline", str(DEADLINE_S)],
                                env=group_env, stdout=output, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def _committed(out: Path) -> dict[tuple[int, int], dict[int, list[int]]]:
    """Each rank's committed steps and the members each step averaged over, from its log."""
    logs: dict[tuple[int, int], dict[int, list[int]]] = {}
    for path in out.glob("log_*.jsonl"):
        replica, rank = map(int, path.stem.split("_")[1:])
        logs[replica, rank] = {e["step"]: e["members"] for e in map(json.loads, path.open())
                               if e["committed"]}
    return logs


def _assert_one_history(out: Path) -> None:
    """Every rank that committed a step logged the same members for it, and the ranks that
    saved a final state at the same committed step hold the same weights: no replica trained
    on answers of its own."""
    by_step: dict[tuple[int, int], list[int]] = {}
    for (_, rank), steps in _committed(out).items():
        for step, members in steps.items():
            assert by_step.setdefault((rank, step), members) == members, (rank, step)
    for rank in (0, 1):
        finals = [torch.load(p) for p in sorted(out.glob(f"final_*_{rank}.pt"))]
        for a in finals[1:]:
            if a["committed_steps"] == finals[0]["committed_steps"]:
                for name, value in a["model"].items():
                    assert torch.equal(value, finals[0]["model"][name]), (rank, name)


def _wait(procs: list[subprocess.Popen[str]], out: Path, bound: float) -> list[str]:
    """Every group's output once all exited; fails, killing them, past `bound` seconds."""
    deadline = time.monotonic() + bound
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for q in procs:  # the launcher and its ranks (a session of their own)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(q.pid, signal.SIGKILL)
        tails = {g: (out / f"group_{g}.out").read_text()[-3000:] for g in range(len(procs))}
        pytest.fail(f"the job hung: groups {[q.returncode for q in procs]} (None: still "
                    f"running) after {bound:.0f} s; their last output: {tails}")
    return [(out / f"group_{g}.out").read_text() for g in range(len(procs))]


@other_user
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(JOB_BOUND_S + 60)
@pytest.mark.parametrize("mode", ["pass", "tamper", "once"])
def test_a_relay_of_another_user_reads_nothing_and_changes_nothing(
        mode: str, tmp_path: Path, shared_dir: str) -> None:
    """The coordinator served alone, two groups of 2 ranks started by hand and pointed at a
    relay of uid 65534 in its place. "pass": the job exits 0, both replicas equal, and none
    of the plaintext it sends or gets is in the relay's copy (on the hand-made handshake
    before TLS, `commit/` was). "tamper": once a step is committed, the relay changes one
    bit of the next record the server sends on each connection: every group exits non-zero
    within TAMPER_BOUND_S naming the relayed connection as broken, and every step committed
    holds one history. "once": one bit of one such record in all; every group still exits
    within JOB_BOUND_S, and one that exits non-zero names the broken connection. The
    managers' and heals' connections are relayed in process only (test_ft_relay.py,
    test_ft_strangers.py): their addresses reach the ranks through each
    group's store and the quorum."""
    env = {**os.environ, CERT_ENV: JOB_PEM, "PYTHONPATH": str(REPO)}
    capture = os.path.join(shared_dir, "capture")
    coordinator, port = _start_coordinator(env)
    relay: subprocess.Popen[str] | None = None
    went = 0.0  # when the relay was told to change bytes (tamper)
    groups: list[subprocess.Popen[str]] = []
    try:
        relay = start_as_other(RELAY_CODE, str(port), capture, mode)
        assert relay.stdout is not None
        relay_port = int(relay.stdout.readline())
        started = time.monotonic()
        groups = [_start_group(g, relay_port, tmp_path, env) for g in (0, 1)]
        if mode != "pass":  # once training has committed a step through the relay
            while not any(_committed(tmp_path).values()) and all(
                    g.poll() is None for g in groups):
                time.sleep(0.1)
            Path(capture + ".go").touch()
            went = time.monotonic()
        outputs = _wait(groups, tmp_path, JOB_BOUND_S)
        ended = time.monotonic()
    finally:
        for p in (*groups, coordinator, relay):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    seen = Path(capture).read_bytes()
    assert len(seen) > 10_000  # the job's traffic went through the relay
    for clear in CLEAR:
        assert clear not in seen, clear
    codes = [g.returncode for g in groups]
    _assert_one_history(tmp_path)
    report: dict[str, Any] = {"codes": codes, "job_s": round(ended - started, 1)}
    if mode == "pass":
        assert codes == [0, 0], outputs
        # Every rank ends with exactly STEPS committed steps, one history. A group that came
        # up late heals into the steps the other one trained alone meanwhile, which holds at
        # STEPS until it is back: the late one may log no step of its own.
        finals = [torch.load(p)["committed_steps"] for p in sorted(tmp_path.glob("final_*"))]
        assert finals == [STEPS] * 4, (report, finals)
        logs = _committed(tmp_path)
        assert all(max(steps, default=-1) < STEPS for steps in logs.values()), (report, logs)
        return
    flips = Path(capture + ".flips").read_text().split("\n")
    assert flips[0], "the relay changed no byte"
    if mode == "once":  # one connection broke: its group stops, the other may finish
        broken = f"the connection to 127.0.0.1:{relay_port} broke"
        assert codes == [0, 0] or any(broken in output for output in outputs), (
            report, [output[-3000:] for output in outputs])
        return
    # Every connection to the coordinator now breaks at its next answer: no group can finish
    # (each step's claim goes through it), and each says which connection broke.
    assert all(code != 0 for code in codes), (report, outputs)
    assert ended - went < TAMPER_BOUND_S, report
    for output in outputs:
        assert f"the connection to 127.0.0.1:{relay_port} broke" in output, output[-4000:]
