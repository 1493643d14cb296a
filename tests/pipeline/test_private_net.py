"""`python -m pipeline.launch --private-network`: the job's loopback servers out of reach."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline import private_net

pytestmark = pytest.mark.dist

WHY_NOT = private_net.unavailable()
JOB = Path(__file__).with_name("private_net_job.py")


def _reachable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no private network here: {WHY_NOT}")
def test_a_replica_jobs_servers_are_reachable_only_from_inside(tmp_path: Path) -> None:
    """The job's lighthouse and record (one server) and the rendezvous stores listen on
    loopback: inside, the job's ranks reach them and train; from this process, on
    the host's loopback, nothing answers on those ports while the job still holds them."""
    pytest.importorskip("torchft")
    job = subprocess.Popen([sys.executable, "-m", "pipeline.launch", "--private-network",
                            "--replicas", "1", "--nproc", "2", str(JOB), str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        report = tmp_path / "ports.json"
        deadline = time.monotonic() + 240
        while not report.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert report.exists(), f"the job wrote no report (exit {job.poll()})"
        got = json.loads(report.read_text())
        outside = {name: _reachable(port) for name, port in got["ports"].items()}
        (tmp_path / "done").touch()
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, output
    assert got["marker"] == "1" and got["committed"] == 2
    assert got["inside"] == {"lighthouse": True, "record": True}
    assert outside == {"lighthouse": False, "record": False}


def test_no_private_network_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Where the host refuses unprivileged namespaces, the launch ends at once, saying so and
    how to enable them; it never starts the job on the shared loopback instead."""
    monkeypatch.setattr(private_net, "unavailable", lambda: "OSError: unshare: refused")
    monkeypatch.delenv(private_net.INSIDE_ENV, raising=False)
    from pipeline import launch

    assert launch.main(["--private-network", "--nproc", "2", os.devnull]) == 1
    err = capsys.readouterr().err
    assert "--private-network needs unprivileged user and network namespaces" in err
    assert "unshare: refused" in err and "run without it" in err


def test_a_sigterm_as_the_job_starts_reaches_it_and_never_orphans_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher outside the namespace installed its forwarding handler after starting the
    job: a SIGTERM in between ended it by the default action, the job running on without it.
    Here the SIGTERM comes as the job is started (a fake child): it must reach the job, and
    the launcher must wait for it and return its status."""
    monkeypatch.setattr(private_net, "unavailable", lambda: None)
    handler: list[Any] = []
    got: list[int] = []

    class Child:
        def __init__(self, *_args: Any, **_kwargs: Any) -> None:
            handler.append(signal.getsignal(signal.SIGTERM))
            if handler[0] is not signal.SIG_DFL:  # raised with the default, it ends pytest
                signal.raise_signal(signal.SIGTERM)

        def send_signal(self, signum: int) -> None:
            got.append(signum)

        def wait(self) -> int:
            return -signal.SIGTERM if got else 0

    monkeypatch.setattr(private_net.subprocess, "Popen", Child)
    before = signal.getsignal(signal.SIGTERM)
    assert private_net.relaunch(["--nproc", "2", os.devnull]) == -signal.SIGTERM
    assert handler[0] is not signal.SIG_DFL, "SIGTERM's default action was still set"
    assert got == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is before
