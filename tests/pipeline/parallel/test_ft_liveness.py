"""Every rank's liveness and the job's configuration, kept in the job's record: a stalled rank of
any group is seen by the launcher; groups that disagree on the count, and configuration errors,
end the job at once instead of being retried."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import PipeConfigError
from pipeline.replicas import beats as ft_beats
from pipeline.replicas import record as ft_record
from pipeline.replicas.coordinator import serve_coordinator
from pipeline.replicas.record import JobRecord, Liveness

pytest.importorskip("torchft")

from pipeline.replicas import launch as replica_launch

GIVE_UP = str(Path(__file__).parents[1] / "ft_give_up.py")
LAUNCH_TIMEOUT = 240  # a hang guard, never an expected duration


@pytest.fixture
def record(job_cert: Any) -> Iterator[tuple[Any, int]]:
    """The job's record, kept by a coordinator as the launcher keeps it (this process and
    the ranks it starts hold the job's certificate)."""
    with serve_coordinator() as (server, _, store):
        yield store, server.port


def _wait(cond: Any, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "no progress within a minute"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_stopped_rank_stops_beating_and_is_seen(record: tuple[Any, int]) -> None:
    """A rank beats from a daemon thread that a SIGSTOP stops with the rest of it: the
    launcher's watch names it once its count has not moved for the timeout, and not before;
    continued, it beats again; at its exit it says so and is watched no more."""
    store, port = record
    # Up until its stdin closes, then a normal exit.
    code = ("import sys\nfrom pipeline.replicas.record import JobRecord\n"
            "JobRecord.from_environment(0, 30)\nsys.stdin.read()\n")
    env = {**os.environ, ft_record.RECORD_ENV: str(port), ft_beats.LIVENESS_ENV: "1.0"}
    rank = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE)
    try:
        watch = Liveness(store, timeout=1.0)
        _wait(lambda: watch.stalled([rank.pid]) is None and watch.seen.get(rank.pid))
        start = watch.seen[rank.pid][0]
        _wait(lambda: watch.stalled([rank.pid]) is None and watch.seen[rank.pid][0] > start)
        rank.send_signal(signal.SIGSTOP)
        found: list[tuple[int, float]] = []
        _wait(lambda: found.append(got) is None if (got := watch.stalled([rank.pid])) else False)
        pid, silent = found[0].pid, found[0].silent
        assert pid == rank.pid and silent > 1.0  # never before the timeout
        rank.send_signal(signal.SIGCONT)
        count = watch.seen[rank.pid][0]
        _wait(lambda: watch.stalled([rank.pid]) is None and watch.seen[rank.pid][0] > count)
        rank.communicate(b"", timeout=60)  # a normal exit: it says so, and is watched no more
        assert rank.returncode == 0
        assert int(store.add(ft_beats.beat_key(rank.pid), 0)) >= ft_beats.EXITING
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_seen_within_the_timeout_beside_busy_processes(
        record: tuple[Any, int], busy: None) -> None:
    """On a loaded host a SIGSTOPped rank waits on no run queue: nothing is taken off its
    silence, and the watch names it within the timeout and a look of the SIGSTOP."""
    store, port = record
    code = ("import sys\nfrom pipeline.replicas.record import JobRecord\n"
            "JobRecord.from_environment(0, 30)\nsys.stdin.read()\n")
    env = {**os.environ, ft_record.RECORD_ENV: str(port), ft_beats.LIVENESS_ENV: "2.0"}
    rank = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE)
    try:
        watch = Liveness(store, timeout=2.0)
        _wait(lambda: watch.stalled([rank.pid]) is None and watch.seen.get(rank.pid))
        rank.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        found: list[ft_record.Stall] = []
        _wait(lambda: found.append(got) is None if (got := watch.stalled([rank.pid])) else False)
        seen_after = time.monotonic() - stopped
        assert found[0].pid == rank.pid and found[0].starved < 0.5, found
        assert seen_after < 2.0 + 1.0, (seen_after, found)  # the timeout, and slack for a look
    finally:
        rank.kill()
        rank.wait()


# A rank held off the CPU: every thread of it (its beating thread too) pinned to one CPU in the
# idle class, beside processes pinned there that spin (SCHED_IDLE runs only when nothing else
# on its CPU is runnable; no privilege is needed to enter it). Its main thread spins too, so
# the beating thread also waits for the GIL that a starved thread holds.
_STARVED_RANK = """\
import os, sys
from pipeline.replicas.record import JobRecord
JobRecord.from_environment(0, 30)
cpu = int(sys.stdin.readline())
for tid in os.listdir("/proc/self/task"):
    os.sched_setaffinity(int(tid), {cpu})
    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
print("starved", flush=True)
while True:
    pass
"""
_PINNED_SPIN = ("import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\n"
                "parent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n")


# `alone`: three processes spin pinned to one CPU beside one busy process per core, more load
# than any other test is held to; on the suite's workers no test runs beside it
# (tests/workers.py).
@pytest.mark.alone
@pytest.mark.timeout(120)
def test_a_rank_starved_of_the_cpu_past_the_timeout_is_not_stalled(
        record: tuple[Any, int], busy: None) -> None:
    """A live rank silent for longer than the timeout because it waited for a CPU (its
    silence ends with a beat) is not taken for stalled: the time its threads waited on a run
    queue is taken off its silence. Before, the watch ended it at the timeout (a loaded host
    restarted live groups, up to --max-restarts)."""
    if not hasattr(os, "SCHED_IDLE") or not Path(
            f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists():
        pytest.skip("needs Linux's SCHED_IDLE and run-queue waits (CONFIG_SCHED_INFO)")
    store, port = record
    timeout = 1.0
    cpu = max(os.sched_getaffinity(0))
    env = {**os.environ, ft_record.RECORD_ENV: str(port), ft_beats.LIVENESS_ENV: str(timeout)}
    rank = subprocess.Popen([sys.executable, "-c", _STARVED_RANK], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        watch = Liveness(store, timeout=timeout)
        _wait(lambda: watch.stalled([rank.pid]) is None and watch.seen.get(rank.pid))
        spinners = [subprocess.Popen([sys.executable, "-c", _PINNED_SPIN, str(cpu)])
                    for _ in range(3)]
        assert rank.stdin is not None and rank.stdout is not None
        rank.stdin.write(f"{cpu}\n")
        rank.stdin.flush()
        assert rank.stdout.readline() == "starved\n"
        longest = 0.0  # the longest silence the watch saw that a beat ended
        deadline = time.monotonic() + 60
        while longest <= 2 * timeout and time.monotonic() < deadline:
            count, since = watch.seen[rank.pid]
            stall = watch.stalled([rank.pid])
            assert stall is None, f"a starved rank taken for stalled: {stall}"
            if watch.seen[rank.pid][0] != count:
                longest = max(longest, watch.seen[rank.pid][1] - since)
            time.sleep(0.05)
        assert longest > 2 * timeout, (
            f"the rank was never silent for twice the timeout ({longest:.2f}s at most): it was "
            f"not held off the CPU, and the test shows nothing")
    finally:
        for proc in [rank, *spinners]:
            proc.kill()
            proc.wait()


def test_a_rank_exits_cleanly_with_a_beat_in_flight(record: tuple[Any, int]) -> None:
    """Beats back to back (every 0.1 ms) up to the exit: the beating thread is stopped before
    the interpreter finalizes. Left running, it was ended inside the store's call as it took
    the GIL back, and the rank aborted after its last commit ('terminate called without an
    active exception', SIGABRT; its group restarted and could not heal: exit 1)."""
    _, port = record
    code = ("import time\nfrom pipeline.replicas.record import JobRecord\n"
            "JobRecord.from_environment(0, 30)\ntime.sleep(0.3)\n")
    env = {**os.environ, ft_record.RECORD_ENV: str(port), ft_beats.LIVENESS_ENV: "0.001"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.timeout(180)
def test_a_rank_exiting_after_the_coordinator_is_gone_ends_within_the_liveness_timeout(
        job_cert: Any) -> None:
    """The coordinator gone (the launcher SIGKILLed) while the rank's main thread, not its
    beat, met it first: the rank exits at once and its beats stop; saying so at exit finds
    nobody. That last word is bounded by the liveness timeout (5 s here), not the record's
    (60 s, as ranks use): the rank ends with exit 75 naming the lost coordinator. It
    retried connecting for the record's whole timeout, 60 s, under load."""
    code = ("import sys\nfrom pipeline.replicas.record import JobRecord\n"
            "JobRecord.from_environment(0, 60)\nsys.stdin.read()\n")
    with serve_coordinator() as (server, _, store):
        env = {**os.environ, ft_record.RECORD_ENV: str(server.port),
               ft_beats.LIVENESS_ENV: "5.0"}
        rank = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        watch = Liveness(store, timeout=5.0)
        _wait(lambda: bool(watch.seen.get(rank.pid)) or watch.stalled([rank.pid]) is not None)
    try:
        started = time.monotonic()
        _, err = rank.communicate("", timeout=150)  # exits now; its coordinator is gone
        took = time.monotonic() - started
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    assert rank.returncode == ft_beats.LAUNCHER_LOST_EXIT, err[-2000:]
    assert "did not answer as this rank exited" in err, err[-2000:]
    assert took < 20, (took, err[-2000:])  # 5 s, and slack for a loaded host


_SLOW_LAUNCHER = r"""
import os, subprocess, sys
from pipeline.replicas import beats, record
from pipeline.replicas.coordinator import serve_coordinator
rank_code = ("import sys\nfrom pipeline.replicas.record import JobRecord\n"
             "JobRecord.from_environment(0, 60)\nsys.stdin.read()\n")
with serve_coordinator() as (server, _, store):
    env = {**os.environ, record.RECORD_ENV: str(server.port), beats.LIVENESS_ENV: "1.0",
           beats.LAUNCHER_ENV: str(os.getpid())}
    rank = subprocess.Popen([sys.executable, "-c", rank_code], env=env, stdin=subprocess.PIPE)
    print(rank.pid, flush=True)
    sys.stdin.readline()  # the test says when to end
    rank.stdin.close()
    print(rank.wait(), flush=True)
"""


@pytest.mark.timeout(180)
def test_a_launcher_held_off_the_cpu_is_not_taken_for_lost(job_cert: Any, busy: None) -> None:
    """The launcher that started a rank (its parent) stopped for longer than the liveness
    floor (5 s), as a loaded host may hold it: its coordinator answers no beat meanwhile,
    but the rank's parent is still the launcher, so the rank goes on and ends normally. It
    took the silence for a lost launcher and exited 75 (a live rank ended under load)."""
    launcher = subprocess.Popen([sys.executable, "-c", _SLOW_LAUNCHER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert launcher.stdin is not None and launcher.stdout is not None
    try:
        rank = int(launcher.stdout.readline())
        time.sleep(2.0)  # beating
        launcher.send_signal(signal.SIGSTOP)
        time.sleep(8.0)  # past the floor, with slack for a beat already in flight
        launcher.send_signal(signal.SIGCONT)
        with open(f"/proc/{rank}/stat") as stat:
            assert stat.read().rsplit(")", 1)[1].split()[0] != "Z", "the rank exited"
        launcher.stdin.write("\n")
        launcher.stdin.flush()
        code = launcher.stdout.readline().strip()
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGCONT)
            launcher.kill()
            launcher.wait()
    assert code == "0", err[-2000:]


def test_an_exiting_rank_is_watched_no_more(record: tuple[Any, int]) -> None:
    store, _ = record
    watch = Liveness(store, timeout=0.2)
    store.add(ft_beats.beat_key(11), 3)
    assert watch.stalled([11]) is None
    store.add(ft_beats.beat_key(11), ft_beats.EXITING)
    time.sleep(0.3)
    assert watch.stalled([11]) is None and watch.stalled([12]) is None  # 12: not beating yet


def test_a_launcher_held_off_the_cpu_blames_no_rank(record: tuple[Any, int]) -> None:
    """The watch itself not run for longer than half the timeout (the launcher starved, or
    the host suspended) says nothing of the ranks: each gets a fresh window."""
    store, _ = record
    watch = Liveness(store, timeout=1.0)
    store.add(ft_beats.beat_key(21), 1)
    assert watch.stalled([21]) is None
    time.sleep(1.3)  # no look for longer than the timeout
    assert watch.stalled([21]) is None
    found: list[tuple[int, float]] = []  # watched all along now, and silent: stalled
    _wait(lambda: found.append(got) is None if (got := watch.stalled([21])) else False)
    assert found[0][0] == 21 and found[0][1] > 1.0


def test_replica_group_counts_that_differ_are_refused_at_join(
        record: tuple[Any, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups started by hand with NUM_REPLICA_GROUPS 2 and 3: the second to join is refused,
    naming both values (before, gloo aborted one when their buffers disagreed and the other
    trained alone, exit 0)."""
    _, port = record
    monkeypatch.setenv(ft_record.RECORD_ENV, str(port))
    monkeypatch.delenv(ft_beats.LIVENESS_ENV, raising=False)
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    assert JobRecord.from_environment(0, 10) is not None
    assert JobRecord.from_environment(0, 10) is not None  # a restart of the same count
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "3")
    with pytest.raises(PipeConfigError, match=r"NUM_REPLICA_GROUPS=3 in replica group 1.*"
                                              r"holds 2"):
        JobRecord.from_environment(1, 10)


@pytest.mark.parametrize(("error", "config"), [
    (PipeConfigError("x"), True), (ValueError("x"), True), (TypeError("x"), True),
    (RuntimeError("x"), False), (KeyboardInterrupt(), False), (SystemExit(2), False)])
def test_which_rank_errors_are_configuration_errors(error: BaseException,
                                                    config: bool) -> None:
    assert replica_launch.is_config_error(error) is config


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_configuration_error_ends_the_job_at_once(tmp_path: Path) -> None:
    """Replica group 1 runs with NUM_REPLICA_GROUPS=3 in a job of 2: its ranks are refused at
    join (PipeConfigError) and exit with the configuration code; the launcher does not
    restart the group (it did, --max-restarts times), stops the other group, and exits with
    that code, naming the group, the rank and the error."""
    cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", "2", "--nproc", "2",
           "--max-restarts", "3", GIVE_UP, str(tmp_path), "--count", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                          check=False)
    assert done.returncode == replica_launch.CONFIG_EXIT, done.stderr[-4000:]
    assert "restarting" not in done.stderr, done.stderr[-4000:]
    assert sorted((tmp_path / "starts_1").read_text().split()) == ["0", "1"]  # started once
    assert re.search(r"replica group 1 rank [01]: configuration error \(exit code 78\), not "
                     r"retried: PipeConfigError: NUM_REPLICA_GROUPS=3 in replica group 1",
                     done.stderr), done.stderr[-4000:]
    assert "holds 2" in done.stderr
    assert sorted(p.name for p in tmp_path.glob("stopped_*")) == ["stopped_0_0", "stopped_0_1"]


def test_a_rank_runs_its_script_as_python_does(tmp_path: Path) -> None:
    """Through the launcher's boot, the script sees what `python script.py ARGS` shows it
    (argv, its directory first on the path, __main__), and an error that is not a
    configuration error ends it with exit code 1 and its traceback, as before."""
    script = tmp_path / "rank.py"
    script.write_text("import sys\n"
                      "print(sys.argv, sys.path[0], __name__, flush=True)\n"
                      "raise RuntimeError('lost a peer')\n")
    done = subprocess.run([sys.executable, "-c", replica_launch._BOOT, str(script), "a", "-b"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    assert done.stdout.split() == [f"['{script}',", "'a',", "'-b']", str(tmp_path), "__main__"]
    assert "RuntimeError: lost a peer" in done.stderr
