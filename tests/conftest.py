"""Shared test configuration: hypothesis profiles (registered once here) and markers."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests import workers
from tests.busy import busy_cores
from tests.limits import DIST_TEST_TIMEOUT
from tests.other_user import shared_dir  # noqa: F401  (a fixture: a directory two users share)

settings.register_profile(
    "dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# CI: the same examples on every run, so a red build is reproducible.
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(autouse=True)
def _plans_cache(tmp_path_factory: pytest.TempPathFactory,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner remembers its last choice in the user's cache (pipeline/planner/
    remembered.py): every test gets a cache of its own, never the real home's, and no test
    sees what another chose."""
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def busy() -> Iterator[None]:
    """One spinning process per core while the test runs (tests/busy.py): for tests of what
    must hold on a loaded machine (exits, kills, waits on other threads)."""
    with busy_cores():
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that spawn processes get a hang guard above spawn's own (see tests/limits.py);
    # pyproject's 120 s stays the limit of everything else.
    for item in items:
        if item.get_closest_marker("dist") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(DIST_TEST_TIMEOUT))
    workers.group_shared(config, items)  # on the suite's workers (tests/workers.py)


# The suite on pytest-xdist's workers (`make unit`): tests that share a module's fixture on
# one worker, and `alone` tests with none beside them (tests/workers.py).
@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    workers.configure_node(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    return workers.Grouped(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_unconfigure(config: pytest.Config) -> None:
    workers.remove_run_directory(config)


# tryfirst: outside pytest-timeout's timer, so that a test waiting for its turn (an `alone`
# test for the others to end, or the others for it) is not timed meanwhile.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if not workers.on_worker(item.config):
        yield
        return
    with workers.turn(workers.worker_directory(item.config),
                      alone=item.get_closest_marker(workers.ALONE) is not None):
        yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A test that broke a process group in this process armed its quiet exit, which ends the
    # process with the code it recorded: `python -m pytest` raises SystemExit itself, so its
    # status is recorded here, or a failing run would exit 0.
    quiet_exit = sys.modules.get("pipeline.comm.quiet_exit")
    if quiet_exit is not None:
        quiet_exit.record(int(exitstatus))
