"""Warm spares: a replica group of one process, spares that wait, take a lost id, and end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.spares import kill_to_healed
from pipeline import PipeConfigError
from pipeline.replicas.spares import SPARE_ENV
from tests.pipeline import ft_train
from tests.pipeline.parallel.test_fault_tolerance import (
    LAUNCH_TIMEOUT,
    TRAIN,
    _assert_equal_to_replay,
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



# -- spares -----------------------------------------------------------------------------------
def test_spares_need_replicas_and_a_count_of_0_or_more(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.launch import main as launch_main

    with pytest.raises(SystemExit) as exit_info:
        launch_main(["--nproc", "2", "--spares", "1", TRAIN])
    assert exit_info.value.code == 2
    assert "--spares 1 needs --replicas" in capsys.readouterr().err
    pytest.importorskip("torchft")
    with pytest.raises(SystemExit):
        launch_main(["--replicas", "2", "--nproc", "2", "--spares", "-1", TRAIN])
    assert "--spares >= 0; got --replicas 2, --max-restarts 3, --spares -1" in (
        capsys.readouterr().err)


def test_a_spare_rank_without_the_record_says_what_to_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.replicas import record, spares

    monkeypatch.setenv(spares.SPARE_ENV, "0")
    monkeypatch.delenv(record.RECORD_ENV, raising=False)
    with pytest.raises(PipeConfigError, match=r"PIPELINE_FT_SPARE='0', PIPELINE_FT_RECORD=''"):
        spares.await_replica_id(5.0, 0)


def test_a_rank_that_is_no_spare_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.replicas import spares

    monkeypatch.delenv(spares.SPARE_ENV, raising=False)
    spares.await_replica_id(5.0, 0)  # returns at once: no record is even asked


# A spare's rank 1: it waits for an id, then builds its record as a replica group's rank does
# (replica.FaultTolerance) and waits on, beating, until its stdin closes.
_SPARE_RANK = """\
import os, sys
from pipeline.replicas.record import JobRecord
from pipeline.replicas.spares import await_replica_id
await_replica_id(60.0, 1)
JobRecord.from_environment(int(os.environ["REPLICA_GROUP_ID"]), 60.0, 1,
                           lambda: "its last save: ckpt/step_3")
print("took", os.environ["REPLICA_GROUP_ID"], flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(120)
def test_a_spare_that_took_a_groups_id_names_itself_as_that_group(job_cert: object) -> None:
    """A spare's rank that took replica group 2's id, its coordinator then lost: it names
    itself "replica group 2 rank 1 (was spare group 0)" and says where its last committed
    state is. It kept the name it beat under while it waited ("spare group 0 rank 1"), and
    said its state was unknown, as if it were still a spare holding none."""
    pytest.importorskip("torchft")
    from pipeline.replicas import beats, record, spares
    from pipeline.replicas.coordinator import serve_coordinator
    from pipeline.replicas.environment import NUM_REPLICAS_ENV, REPLICA_ID_ENV

    del job_cert
    with serve_coordinator() as (server, _, store):
        env = {**os.environ, spares.SPARE_ENV: "0", record.RECORD_ENV: str(server.port),
               beats.LIVENESS_ENV: "1.0"}
        for name in (REPLICA_ID_ENV, NUM_REPLICAS_ENV, beats.LAUNCHER_ENV):
            env.pop(name, None)
        rank = subprocess.Popen([sys.executable, "-c", _SPARE_RANK], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        try:
            store.set(spares.spare_key(0), "2")  # as the launcher hands it a lost group's id
            assert rank.stdout is not None
            assert rank.stdout.readline() == "took 2\n", rank.communicate()[1][-2000:]
        except BaseException:
            rank.kill()
            rank.communicate()
            raise
    try:  # the coordinator is gone: the rank says so, naming itself
        rank.wait(timeout=60)
        _, err = rank.communicate()
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.communicate()
    assert rank.returncode == beats.LAUNCHER_LOST_EXIT, err[-2000:]
    assert (f"pipeline: replica group 2 rank 1 (was spare group 0): the job's coordinator at "
            f"127.0.0.1:{server.port}") in err, err[-2000:]
    assert err.rstrip().endswith("its last save: ckpt/step_3"), err[-2000:]


class Launch:
    """A launch in the background, its stderr in a file the test reads as it goes."""

    def __init__(self, out: Path, replicas: int, nproc: int, *args: str) -> None:
        self.out, self.err_path = out, out.parent / f"{out.name}.stderr"
        cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", str(replicas),
               "--nproc", str(nproc), "--spares", "1", "--heartbeat-timeout", "3", TRAIN,
               str(out), *args]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
        self.err = self.err_path.open("w")
        self.proc = subprocess.Popen(cmd, stderr=self.err, stdout=subprocess.DEVNULL, env=env)
        self.deadline = time.monotonic() + LAUNCH_TIMEOUT

    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, line: str) -> None:
        """Until the launcher's stderr holds `line` (the launch must still run)."""
        while line not in self.stderr():
            assert self.proc.poll() is None, self.stderr()[-4000:]
            assert time.monotonic() < self.deadline, self.stderr()[-4000:]
            time.sleep(0.2)

    def spare_pids(self, number: int) -> list[int]:
        """The launcher's children that are spare `number`'s ranks."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and f"{SPARE_ENV}={number}".encode() in environ:
                pids.append(int(entry.name))
        return sorted(pids)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.err.close()


def test_kill_to_healed_is_read_off_the_first_step_every_replica_held(tmp_path: Path) -> None:
    """The measurement: from the kill's marker to the first committed step with every
    replica, whichever log holds it (not a step alone, not one that was not committed)."""
    (tmp_path / "killed_0").write_text(json.dumps({"t": 100.0, "step": 3}))
    logs = {0: [(99.0, True, [0, 1]), (101.0, True, [0]), (104.0, False, [0, 1]),
                (106.5, True, [0, 1])],
            1: [(99.0, True, [0, 1]), (106.0, True, [0, 1])]}
    for replica, entries in logs.items():
        (tmp_path / f"log_{replica}_0.jsonl").write_text("".join(
            json.dumps({"t": t, "committed": c, "members": m}) + "\n" for t, c, m in entries))
    assert kill_to_healed(tmp_path, 2) == 6.0


@needs_torchft
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_lost_group_s_id_goes_to_the_waiting_spare(tmp_path: Path, busy: None) -> None:
    """Two groups of one process and one spare, beside a spinning process per core: once the
    spare is ready, replica 1 is killed in its forward. The launcher hands its id to the spare
    (no process started), which heals from replica 0 and trains; a spare is started in its
    place, and the job ends exit 0 with that spare told to exit (0). Both replicas end
    bit-identical and equal to the replay of the logged quorums. kill -> healed is printed
    (measured, never asserted beyond a hang guard)."""
    out = tmp_path / "out"
    out.mkdir()
    launch = Launch(out, 2, 1, "3", "--kill", "1:0:3:forward", "--kill-after",
                    str(out / "go"), "--min-step-ms", "20")
    try:
        launch.wait_for("spare group 0 ready")
        (out / "go").touch()
    finally:
        code = launch.finish()
    err = launch.stderr()
    assert code == 0, err[-4000:]
    lost = [line for line in err.splitlines() if " lost rank " in line]
    assert lost == ["pipeline.launch: replica group 1 lost rank 0 (killed by SIGKILL); spare "
                    "group 0 takes its place (restart 1 of at most 3)"], err[-4000:]
    assert "spare group 1 ended with the job (its ranks exited 0)" in err, err[-4000:]
    starts = [json.loads(line) for line in (out / "start_1_0.jsonl").open()]
    assert len(starts) == 2 and starts[1]["step"] >= 3  # the spare began healed, not at 0
    _assert_whole_equal_to_replay(out, (0, 1), _logged_members(out))
    healed = kill_to_healed(out, 2)
    print(f"kill -> healed with a warm spare: {healed:.2f} s (load {os.getloadavg()[0]:.1f})")
    assert healed < LAUNCH_TIMEOUT / 2  # a hang guard only: the speed is measured, not here


@pytest.fixture(scope="module")
def spare_lost_while_waiting(tmp_path_factory: pytest.TempPathFactory
                             ) -> tuple[Path, int, str, list[int]]:
    """One group of 2 ranks and one spare of 2 (4 ranks), beside a spinning process per
    core: once spare 0 is ready its rank 1 is SIGKILLed; once spare 1 (its replacement) is
    ready, the job is told to end. The out dir, the exit code, stderr, every spare rank's
    pid."""
    from tests.busy import busy_cores

    out = tmp_path_factory.mktemp("spares") / "out"
    out.mkdir()
    with busy_cores():
        launch = Launch(out, 1, 2, "3", "--until", str(out / "go"))
        pids = []
        try:
            launch.wait_for("spare group 0 ready")
            pids = launch.spare_pids(0)
            assert len(pids) == 2, pids
            os.kill(pids[1], signal.SIGKILL)
            launch.wait_for("spare group 1 ready")
            pids += launch.spare_pids(1)
            (out / "go").touch()
        finally:
            code = launch.finish()
    return out, code, launch.stderr(), pids


@needs_torchft
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_spare_lost_while_waiting_is_replaced_without_touching_the_job(
        spare_lost_while_waiting: tuple[Path, int, str, list[int]]) -> None:
    """The lost spare's other rank is stopped and spare 1 starts in its place; no replica
    group is lost or restarted, and the job's weights equal the replay (every step held
    the one replica)."""
    out, code, err, _ = spare_lost_while_waiting
    assert code == 0, err[-4000:]
    assert ("spare group 0 lost rank 1 killed by SIGKILL while it waited; it held no "
            "replica's state, the job goes on as it was; spare group 1 starts in its place "
            "(spare loss 1 of at most 3)" in err), err[-4000:]
    assert not [line for line in err.splitlines() if "replica group" in line
                and " lost rank " in line], err[-4000:]
    members = _logged_members(out)
    assert set(members) == {(0,)}
    _assert_equal_to_replay(out, (0,), members)


@needs_torchft
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_job_that_ends_with_a_spare_waiting_exits_0_and_leaves_no_process(
        spare_lost_while_waiting: tuple[Path, int, str, list[int]]) -> None:
    """At the job's end spare 1 is told so through the record: both its ranks exit 0, the
    launcher exits 0, and none of the spares' ranks is left running."""
    _, code, err, pids = spare_lost_while_waiting
    assert code == 0, err[-4000:]
    assert "spare group 1 ended with the job (its ranks exited 0)" in err, err[-4000:]
    assert len(pids) == 4
    for pid in pids:  # gone, or the pid taken again by a process that is no spare
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        assert SPARE_ENV.encode() not in environ, pid
