"""The launcher: its store stays on loopback, forged failure reports are ignored, and a rank
that dies (even before joining) stops the others within the grace period."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.launch import RankFailed, main, spawn
from tests.limits import SPAWN_TIMEOUT
from tests.pipeline import launch_workers

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[3]
_LOOPBACK = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1, ::1


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
def test_the_rendezvous_store_listens_on_loopback_only() -> None:
    for listeners in spawn(launch_workers.store_listeners, 2, timeout=SPAWN_TIMEOUT):
        assert listeners, "nothing listens on MASTER_PORT"
        assert all(a in _LOOPBACK for a in listeners), listeners  # not 0.0.0.0 or ::


def test_failure_reports_not_written_by_our_ranks_are_ignored() -> None:
    losses = spawn(launch_workers.forged_reports, 2, timeout=SPAWN_TIMEOUT)
    assert losses[0] == losses[1]


def test_spawn_stops_the_others_within_its_grace(caplog: pytest.LogCaptureFixture) -> None:
    # Timed from the failure (spawn logs it), not from the start: starting the ranks can take
    # a minute on a loaded machine. Waiting for the timeout would take minutes more.
    with caplog.at_level(logging.INFO, logger="pipeline.launch"), pytest.raises(
            RankFailed, match="rank 1: process died"):
        spawn(launch_workers.exits_early, 2, timeout=SPAWN_TIMEOUT, grace=2)
    failed = [r.created for r in caplog.records if "the others get 2s" in r.getMessage()]
    assert len(failed) == 1, caplog.text
    assert time.time() - failed[0] < 2 + 30  # the grace, then at most 5 s per join


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(body))
    return str(path)


def test_launcher_stops_the_others_when_a_rank_exits_before_joining(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os
        if os.environ["RANK"] == "1":
            sys.exit(3)
        from pipeline.comm import bootstrap
        bootstrap.world()  # waits for rank 1, which never comes
    """)
    start = time.monotonic()
    assert main(["--nproc", "2", "--grace", "1", script]) == 3
    assert time.monotonic() - start < 30


def test_init_timeout_bounds_the_wait_for_a_rank_that_never_joins(tmp_path: Path) -> None:
    # Rank 1 exits cleanly (code 0) without joining: only the init timeout ends rank 0's wait.
    script = _script(tmp_path, """
        import os
        if os.environ["RANK"] == "1":
            sys.exit(0)
        from pipeline.comm import bootstrap
        bootstrap.world()
    """)
    # Well below the default init timeout (300 s): a launch that waited for it times out here.
    # Starting the launcher and rank 0 (each imports torch) takes most of the time.
    proc = subprocess.run([sys.executable, "-m", "pipeline.launch", "--nproc", "2",
                           "--init-timeout", "3", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=SPAWN_TIMEOUT)
    assert proc.returncode != 0
    assert "timeout after 3000ms" in proc.stderr, proc.stderr[-2000:]  # rank 0 gave up at 3 s
