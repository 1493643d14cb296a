"""`python -m pipeline.launch --private-network`: the job's loopback servers out of reach."""

from __future__ import annotations

import errno
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
    assert got["netns"] != os.stat("/proc/self/ns/net").st_ino and got["committed"] == 2
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


# -- a launcher inside is one that the launcher outside started --------------------------------
def _launch_with(monkeypatch: pytest.MonkeyPatch, mark: str | None) -> tuple[int, list[Any]]:
    """`launch.main(--private-network ...)` with `mark` in the environment; its status and
    the relaunches it asked for (none made: a fake relaunch returns 7)."""
    from pipeline import launch

    asked: list[Any] = []
    monkeypatch.setattr(private_net, "relaunch", lambda argv: asked.append(list(argv)) or 7)
    if mark is None:
        monkeypatch.delenv(private_net.INSIDE_ENV, raising=False)
    else:
        monkeypatch.setenv(private_net.INSIDE_ENV, mark)
    return launch.main(["--private-network", "--nproc", "1", os.devnull]), asked


@pytest.mark.parametrize("mark", [None, "1", "", "9999:1:2", "0:0:0", "garbage"])
def test_an_inherited_variable_never_turns_the_namespace_off(
        monkeypatch: pytest.MonkeyPatch, mark: str | None) -> None:
    """`PIPELINE_PRIVATE_NETWORK=1` left in the environment ran the ranks in the host's
    network namespace, exit 0, no warning."""
    assert _launch_with(monkeypatch, mark) == (7, [["--private-network", "--nproc", "1",
                                                     os.devnull]])
    assert private_net.INSIDE_ENV not in os.environ  # nor passed on to the ranks


def test_a_variable_naming_another_pipe_is_ignored_and_the_pipe_left_unread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ours, other = os.pipe(), os.pipe()
    try:
        os.write(ours[1], b"what this process's reader is owed")
        st = os.fstat(other[0])
        status, asked = _launch_with(monkeypatch, f"{ours[0]}:{st.st_dev}:{st.st_ino}")
        assert (status, len(asked)) == (7, 1)
        assert os.read(ours[0], 100) == b"what this process's reader is owed"
    finally:
        for fd in (*ours, *other):
            os.close(fd)


def test_a_marked_launcher_in_the_hosts_namespace_refuses_to_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The mark of the launcher outside (the pipe it passed, holding its network namespace),
    but this process still in that namespace: the job would run on the host's loopback."""
    read, write = os.pipe()
    st = os.stat("/proc/self/ns/net")
    os.write(write, f"{st.st_dev}:{st.st_ino}".encode())
    os.close(write)
    pipe = os.fstat(read)
    status, asked = _launch_with(monkeypatch, f"{read}:{pipe.st_dev}:{pipe.st_ino}")
    assert (status, asked) == (1, [])
    err = capsys.readouterr().err
    assert "--private-network" in err and "the host's network namespace" in err


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no private network here: {WHY_NOT}")
def test_the_job_runs_in_a_namespace_of_its_own_whatever_the_environment(
        tmp_path: Path) -> None:
    script = tmp_path / "where.py"
    script.write_text("import os, sys\n"
                      "with open(sys.argv[1], 'w') as f:\n"
                      "    f.write(str(os.stat('/proc/self/ns/net').st_ino))\n")
    out = tmp_path / "netns"
    done = subprocess.run([sys.executable, "-m", "pipeline.launch", "--private-network",
                           "--nproc", "1", str(script), str(out)],
                          env={**os.environ, private_net.INSIDE_ENV: "1"},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert int(out.read_text()) != os.stat("/proc/self/ns/net").st_ino


# -- a refused namespace names the kernel's reason and setting ---------------------------------
def _refuse(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def refused(_flags: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(private_net, "_unshare", refused)


def _setting(name: str) -> str:
    return (Path("/proc/sys") / name.replace(".", "/")).read_text().strip()


def test_a_namespace_refused_for_its_limit_names_errno_and_the_limits(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It said `SubprocessError: Exception occurred in preexec_fn` (the ENOSPC lost) and
    suggested kernel.unprivileged_userns_clone, which this kernel may not have."""
    _refuse(monkeypatch, errno.ENOSPC)
    why = private_net.unavailable()
    assert why is not None and "preexec_fn" not in why
    assert "unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: ENOSPC (No space left on device)" in why
    for name in ("user.max_user_namespaces", "user.max_net_namespaces"):
        assert f"{name} = {_setting(name)}" in why
    if not Path("/proc/sys/kernel/unprivileged_userns_clone").exists():
        assert "unprivileged_userns_clone" not in why
    from pipeline import launch

    monkeypatch.delenv(private_net.INSIDE_ENV, raising=False)
    assert launch.main(["--private-network", "--nproc", "1", os.devnull]) == 1
    err = capsys.readouterr().err
    assert "ENOSPC (No space left on device)" in err and "preexec_fn" not in err


@pytest.mark.parametrize(("files", "named", "unnamed"), [
    ({"kernel/unprivileged_userns_clone": "0", "user/max_user_namespaces": "100"},
     ["kernel.unprivileged_userns_clone = 0"], ["max_user_namespaces", "apparmor"]),
    ({"kernel/apparmor_restrict_unprivileged_userns": "1"},
     ["kernel.apparmor_restrict_unprivileged_userns = 1"], ["unprivileged_userns_clone ="]),
    ({"user/max_user_namespaces": "100"},
     ["no setting of this kernel forbids it", "seccomp"], ["unprivileged_userns_clone"]),
])
def test_a_namespace_refused_by_permission_names_this_kernels_setting(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, files: dict[str, str],
        named: list[str], unnamed: list[str]) -> None:
    """The settings named are the ones this kernel has (a fake /proc/sys here)."""
    for name, value in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(value + "\n")
    monkeypatch.setattr(private_net, "SYSCTL", str(tmp_path))
    _refuse(monkeypatch, errno.EPERM)
    why = private_net.unavailable()
    assert why is not None and "EPERM (Operation not permitted)" in why
    assert all(n in why for n in named) and not any(u in why for u in unnamed), why
