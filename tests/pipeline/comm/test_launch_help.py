"""The launchers' help: every option with its default; a missing script refused before any rank."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline import launch
from pipeline.launch import main, spawn
from pipeline.replicas import launch as replica_launch

ROOT = Path(__file__).resolve().parents[3]


def _help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_launch_help_shows_every_default_and_the_grace_agrees_with_spawn(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` hid its defaults, and `--grace` was 10 where `spawn()` used 15."""
    text = _help(capsys)
    grace = inspect.signature(spawn).parameters["grace"].default
    assert f"after one fails (default: {grace:g})" in text
    assert "(default: 300" in text  # --init-timeout
    assert "restarts allowed per replica group (default: 3)" in text
    assert "script the training script each rank runs" in text
    assert "args arguments passed on to the script" in text


@pytest.mark.parametrize("extra", [[], ["--replicas", "2"], ["--private-network"]])
def test_a_missing_script_is_refused_before_any_rank_starts(
        extra: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def started(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a rank (or a group, or a namespace) was started")

    monkeypatch.setattr(launch.subprocess, "Popen", started)
    monkeypatch.setattr(launch, "host_store", started)
    monkeypatch.setattr(replica_launch, "run_replicas", started)
    monkeypatch.setattr(launch.private_net, "relaunch", started)
    missing = tmp_path / "trian.py"
    with pytest.raises(SystemExit) as exc:
        main([*extra, "--nproc", "2", str(missing), "--steps", "3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert f"script {str(missing)!r} does not exist" in err


def test_a_directory_without_main_is_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--nproc", "1", str(tmp_path)])
    assert exc.value.code == 2
    assert "is a directory without __main__.py" in capsys.readouterr().err


def test_replica_launch_help_shows_its_options_and_environment() -> None:
    """`python -m pipeline.replica_launch --help` printed only "usage: ... --record" and
    exited 1."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pipeline.replica_launch", "--help"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for shown in ("--record", "--make-cert", "-h, --help", "PIPELINE_FT_CERT", "PIPELINE_FT_BIND",
                  "python -m pipeline.launch --replicas"):
        assert shown in text, shown
    bad = subprocess.run([sys.executable, "-m", "pipeline.replica_launch", "--recrod"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
                         check=False)
    assert bad.returncode == 2 and "--record" in bad.stderr, bad.stderr
