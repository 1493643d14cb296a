"""tests/workers.py: the suite on several workers keeps a module's shared fixture on one worker,
and a test marked `alone` runs with nothing beside it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.workers import turn

ROOT = Path(__file__).resolve().parents[1]


def _held_by_another(path: Path) -> bool:
    """Whether another open file holds `path` locked (this one could not lock it at once)."""
    with path.open("ab") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


def test_an_alone_turn_waits_for_the_running_tests_and_holds_off_new_ones(
        tmp_path: Path) -> None:
    """Each thread opens the lock files itself, as the workers' processes do."""
    order: list[str] = []
    inside = {name: threading.Event() for name in ("a", "b", "c")}
    leave = {name: threading.Event() for name in ("a", "b", "c")}

    def test(name: str, alone: bool) -> None:
        with turn(tmp_path, alone):
            order.append(name)
            inside[name].set()
            leave[name].wait(60)

    a = threading.Thread(target=test, args=("a", False))
    a.start()
    assert inside["a"].wait(60)
    b = threading.Thread(target=test, args=("b", True))
    b.start()
    deadline = time.monotonic() + 60
    while not _held_by_another(tmp_path / "gate.lock"):  # b holds the gate, waiting for a
        assert time.monotonic() < deadline, "the alone test never took the gate"
        time.sleep(0.01)
    c = threading.Thread(target=test, args=("c", False))
    c.start()
    assert not inside["b"].is_set()  # a still runs
    leave["a"].set()
    assert inside["b"].wait(60)
    assert not inside["c"].is_set(), "a test started beside the alone one"
    leave["b"].set()
    assert inside["c"].wait(60)
    leave["c"].set()
    for t in (a, b, c):
        t.join(60)
    assert order == ["a", "b", "c"]


def test_running_turns_share(tmp_path: Path) -> None:
    with turn(tmp_path, alone=False), turn(tmp_path, alone=False):
        assert _held_by_another(tmp_path / "running.lock")
    assert not _held_by_another(tmp_path / "running.lock")
    assert not _held_by_another(tmp_path / "gate.lock")


_CONFTEST = """\
from tests.conftest import (  # noqa: F401  (the suite's hooks)
    pytest_collection_modifyitems, pytest_configure_node, pytest_runtest_protocol,
    pytest_unconfigure, pytest_xdist_make_scheduler)
"""
# Two modules whose tests share a module-scoped fixture, tests without one, and one `alone`
# test: each test notes its worker (the fixture its maker's); a test running marks the
# directory `busy/` while it runs, long enough that tests on other workers overlap it.
_SHARED = """\
import os, time
from pathlib import Path
import pytest

OUT = Path(os.environ["WORKERS_OUT"])

@pytest.fixture(scope="module")
def made():
    return os.environ["PYTEST_XDIST_WORKER"]

def _run(name):
    mark = OUT / "busy" / name
    mark.write_text("")
    time.sleep(0.3)
    mark.unlink()
"""
_MODULE = _SHARED + """
@pytest.mark.parametrize("i", range(4))
def test_shared(made, i):
    (OUT / f"{__name__}-{i}").write_text(made + " " + os.environ["PYTEST_XDIST_WORKER"])
    _run(f"{__name__}-{i}")

@pytest.mark.parametrize("i", range(4))
def test_plain(i):
    _run(f"{__name__}-plain-{i}")
"""
_ALONE = _SHARED + """
@pytest.mark.alone
def test_alone():
    assert not list((OUT / "busy").iterdir())
    (OUT / "alone-ran").write_text("")
"""


def test_a_run_on_workers_groups_shared_fixtures_and_runs_alone_tests_alone(
        tmp_path: Path) -> None:
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    (out / "busy").mkdir(parents=True)
    (suite / "conftest.py").write_text(_CONFTEST)
    for name in ("test_one", "test_two"):
        (suite / f"{name}.py").write_text(_MODULE)
    (suite / "test_three.py").write_text(_ALONE)
    env = {**os.environ, "WORKERS_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get(
               "PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "3", "--dist", "loadgroup", "-c", os.devnull,
                           "--rootdir", str(suite), "-o", "markers=alone: x", str(suite)],
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (out / "alone-ran").exists()
    for name in ("test_one", "test_two"):
        seen = {(out / f"{name}-{i}").read_text() for i in range(4)}
        assert len(seen) == 1, seen  # one worker ran them all, and made the fixture once
        made, ran = seen.pop().split()
        assert made == ran
