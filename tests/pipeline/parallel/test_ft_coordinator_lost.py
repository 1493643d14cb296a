"""Ranks of groups started by hand tell a lost coordinator from a slow one: a coordinator
(`python -m pipeline.replica_launch --record`) killed ends them, one held off the CPU does not."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torchft")

from pipeline.replicas import beats as ft_beats
from pipeline.replicas import record as ft_record
from pipeline.replicas import tls as ft_tls
from pipeline.replicas.coordinator import StoreClient
from pipeline.replicas.wire import Client, Server, WireSilent
from tests.pipeline.parallel.conftest import JOB_PEM

# A rank of a group started by hand: no launcher is its parent (none is named). It beats
# until its stdin closes, then exits normally; `last_state` says where its state is.
_RANK = """\
import sys
from pipeline.replicas.record import JobRecord
JobRecord.from_environment(0, float(sys.argv[1]), 0, lambda: "its last save: ckpt/step_7")
print("beating", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def coordinator() -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """`python -m pipeline.replica_launch --record` with the job's certificate, and the
    environment it tells groups to export."""
    env = {**os.environ, ft_tls.CERT_ENV: JOB_PEM}
    served = subprocess.Popen([sys.executable, "-m", "pipeline.replica_launch", "--record"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert served.stdout is not None
        line = served.stdout.readline().split()
        assert line and line[0] == "export", served.communicate()[1][-2000:]
        yield served, {**env, **dict(word.split("=", 1) for word in line[1:])}
    finally:
        if served.poll() is None:
            served.send_signal(signal.SIGCONT)
            served.kill()
        served.communicate()


def _start_rank(env: dict[str, str], timeout: float) -> subprocess.Popen[str]:
    rank_env = {**env, ft_beats.LIVENESS_ENV: "1.0"}  # taken for gone after 5 s (the floor)
    rank_env.pop(ft_beats.LAUNCHER_ENV, None)
    rank = subprocess.Popen([sys.executable, "-c", _RANK, str(timeout)], env=rank_env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert rank.stdout is not None
    assert rank.stdout.readline() == "beating\n", rank.communicate()[1][-2000:]
    return rank


def _beats(env: dict[str, str], pid: int) -> int:
    store = StoreClient("127.0.0.1", int(env[ft_record.RECORD_ENV]), 30.0,
                        tls=ft_tls.JobTLS(JOB_PEM))
    try:
        return int(store.add(ft_beats.beat_key(pid), 0))
    finally:
        store.close()


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.mark.timeout(180)
def test_a_coordinator_held_off_the_cpu_does_not_end_hand_started_ranks(
        coordinator: tuple[subprocess.Popen[str], dict[str, str]], busy: None) -> None:
    """The coordinator SIGSTOPped for 8 s, past the 5 s after which a rank takes a coordinator
    that answers nothing for gone, beside busy processes: its kernel still takes the rank's
    connections (the listening socket is open), so the rank takes it for slow, goes on, beats
    again once it runs, and ends normally. It exited 75, "has answered no beat for 5.0s", as
    a loaded host holding the coordinator off the CPU would have it."""
    served, env = coordinator
    rank = _start_rank(env, 60.0)
    try:
        time.sleep(2.0)  # beating
        served.send_signal(signal.SIGSTOP)
        time.sleep(8.0)
        served.send_signal(signal.SIGCONT)
        before = _beats(env, rank.pid)
        deadline = time.monotonic() + 60
        while _beats(env, rank.pid) == before and rank.poll() is None:
            assert time.monotonic() < deadline, "the rank does not beat again"
            time.sleep(0.2)
        assert rank.poll() is None, rank.communicate()[1][-2000:]
        _, err = rank.communicate("", timeout=60)
    finally:
        _end(rank)
    assert rank.returncode == 0, err[-2000:]


@pytest.mark.timeout(180)
def test_a_coordinator_held_past_the_ranks_timeout_ends_them_saying_it_was_slow(
        coordinator: tuple[subprocess.Popen[str], dict[str, str]]) -> None:
    """Slow is not forever: a coordinator that holds the rank's connections but answers
    nothing for the rank's own timeout (8 s here; every call of the rank to it waits that
    long at most) ends the rank with exit 75, saying it was stopped or held off the CPU, not
    before that timeout."""
    served, env = coordinator
    rank = _start_rank(env, 8.0)
    try:
        time.sleep(1.0)  # beating
        served.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        rank.wait(timeout=120)  # stdin left open: the rank's main thread waits on
        took = time.monotonic() - stopped
        _, err = rank.communicate()
    finally:
        _end(rank)
    assert rank.returncode == ft_beats.LAUNCHER_LOST_EXIT, err[-2000:]
    assert "takes this rank's connections but has answered nothing for" in err, err[-2000:]
    assert "stopped, or held off the CPU" in err, err[-2000:]
    assert took >= 8.0, (took, err[-2000:])
    assert took < 8.0 + 5.0 + 15.0, (took, err[-2000:])  # a beat's wait, and slack for load


@pytest.mark.timeout(180)
def test_a_killed_coordinator_ends_hand_started_ranks_naming_it(
        coordinator: tuple[subprocess.Popen[str], dict[str, str]], busy: None) -> None:
    """The coordinator SIGKILLed: its listening socket is closed, connections are refused, and
    the rank exits 75 within the 5 s (and a beat, and slack for a loaded host), naming the
    coordinator (its address, `--record`) and where its last committed state is."""
    served, env = coordinator
    rank = _start_rank(env, 60.0)
    try:
        time.sleep(1.0)  # beating
        served.kill()
        served.wait()
        killed = time.monotonic()
        rank.wait(timeout=120)
        took = time.monotonic() - killed
        _, err = rank.communicate()
    finally:
        _end(rank)
    port = env[ft_record.RECORD_ENV]
    assert rank.returncode == ft_beats.LAUNCHER_LOST_EXIT, err[-2000:]
    assert (f"replica group 0 rank 0: the job's coordinator at 127.0.0.1:{port}, kept by "
            f"`python -m pipeline.replica_launch --record`") in err, err[-2000:]
    assert "ConnectionRefusedError" in err and "its last save: ckpt/step_7" in err, err[-2000:]
    assert took < 5.0 + 15.0, (took, err[-2000:])



def test_a_beat_tells_a_slow_coordinator_from_a_gone_one_by_the_wire(job_cert: Any) -> None:
    """What a failed request shows, by its exception's type: a listening socket whose process
    runs nothing (a stopped coordinator's: its kernel completes the connection) is slow; a
    kept connection gone silent is undecided (its host may be gone too); a closed port is a
    gone process. The handshake's timeout was a WireRefused, "not one of the job's
    processes", as if another job's process answered."""
    del job_cert
    stopped = socket.socket()
    stopped.bind(("127.0.0.1", 0))
    stopped.listen(8)  # never accepts, as a SIGSTOPped process
    port = stopped.getsockname()[1]
    with pytest.raises(WireSilent, match="took the connection but said nothing") as slow:
        Client("127.0.0.1", port, connect_timeout=0.5).call({"op": "add"}, 0.5)
    assert slow.value.fresh and ft_beats._shows(slow.value) == ft_beats._SLOW
    stopped.close()
    with pytest.raises(ConnectionRefusedError) as refused:
        Client("127.0.0.1", port, connect_timeout=0.3).call({"op": "add"}, 0.3)
    assert ft_beats._shows(refused.value) == ft_beats._GONE

    server = Server(lambda request: time.sleep(float(request["sleep"])))
    try:
        kept = Client("127.0.0.1", server.port)
        kept.call({"sleep": 0.0}, 5.0)  # the connection is kept from here on
        with pytest.raises(WireSilent, match=r"answered nothing within 0\.3s") as silent:
            kept.call({"sleep": 1.0}, 0.3)
        assert not silent.value.fresh
        assert ft_beats._shows(silent.value) == ft_beats._UNDECIDED
    finally:
        server.close()
