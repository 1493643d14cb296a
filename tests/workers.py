"""The suite on several pytest-xdist workers at once (`make unit` runs `-n 3 --dist loadgroup`).

Most tests wait (ranks starting, heartbeats, timeouts), so several run side by side. Two
things must still hold there, and this module keeps them (tests/conftest.py calls it):

- Tests that share a module- or class-scoped fixture run on one worker: such a fixture
  spawns ranks once for a module's scenarios (tests/pipeline/in_turn.py) or exports a model
  once (tests/models_traced.py), and a second worker would build it again. `group_shared`
  gives each such test an `xdist_group` named for its module, unless it has one already
  (the docs' chains of `continue` blocks name theirs, tests/test_docs.py).
- A test marked `alone` runs with no other test beside it: one that loads the machine on
  purpose past what the others are held to (CPUs pinned and starved), or that must see the
  machine quiet to show anything. `turn` holds a lock that every other test shares: an
  `alone` test waits for the running ones to end, and no new one starts until it has.

Without workers (a plain `pytest` run), nothing is grouped or locked.

xdist's own `--dist loadgroup` reads the `xdist_group` marks by renaming each grouped test
(`nodeid@group`), which pytest 9.2's structured test ids no longer let it do: it silently
groups nothing (pytest-dev/pytest-xdist#1386). So each worker writes the groups it collected
to the run's directory, which the controller makes and hands to each worker, and the
scheduler `Grouped` (still `--dist loadgroup` on the command line) reads them from there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from xdist.scheduler import LoadGroupScheduling

__all__ = ["ALONE", "SHARED_SCOPES", "Grouped", "configure_node", "group_shared", "on_worker",
           "remove_run_directory", "run_directory", "turn", "worker_directory"]

ALONE = "alone"  # the marker's name (registered in pyproject.toml)
SHARED_SCOPES = ("class", "module", "package")


def on_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker (not a plain run, nor a pytest that a test
    started: those have no `workerinput`, whatever the environment they inherited)."""
    return hasattr(config, "workerinput")


_RUN_DIR = pytest.StashKey[Path]()
_WORKER_KEY = "pipeline_tests_run_dir"  # in each worker's `workerinput`


def run_directory(config: pytest.Config) -> Path:
    """The controller's directory for this run, shared with its workers (made at the first
    call; `remove_run_directory` removes it at the run's end)."""
    if _RUN_DIR not in config.stash:
        config.stash[_RUN_DIR] = Path(tempfile.mkdtemp(prefix="pytest-workers-"))
    return config.stash[_RUN_DIR]


def remove_run_directory(config: pytest.Config) -> None:
    if _RUN_DIR in config.stash:
        shutil.rmtree(config.stash[_RUN_DIR], ignore_errors=True)


def configure_node(node: Any) -> None:
    """On the controller, as a worker is made: hand it the run's directory."""
    node.workerinput[_WORKER_KEY] = str(run_directory(node.config))


def worker_directory(config: pytest.Config) -> Path:
    """On a worker: the run's directory, from the controller."""
    workerinput: dict[str, Any] = getattr(config, "workerinput")  # noqa: B009
    return Path(workerinput[_WORKER_KEY])


def _group_of(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    info = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames if info is not None else ():
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope in SHARED_SCOPES:
            return item.nodeid.split("::")[0]  # the module's path
    return None


def group_shared(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: every test's group (its `xdist_group` mark, else its module's path when
    it uses a fixture of a wider scope than the test: see the module docstring), written
    for the controller's scheduler."""
    if not on_worker(config):
        return
    groups = {item.nodeid: g for item in items if (g := _group_of(item)) is not None}
    directory = worker_directory(config)
    name = f"groups-{os.getpid()}.json"
    (directory / f".{name}").write_text(json.dumps(groups))
    os.replace(directory / f".{name}", directory / name)  # whole, or not there at all


class Grouped(LoadGroupScheduling):
    """xdist's `loadgroup` scheduling, with the groups the workers wrote: each group is one
    unit of work, for one worker (largest first), and every other test a unit of its own."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self._directory = run_directory(config)
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        scope = super()._split_scope(nodeid)
        if scope != nodeid:  # a group xdist itself read (its `nodeid@group`)
            return scope
        if self._groups is None:  # read once every worker has collected
            self._groups = {}
            for path in sorted(self._directory.glob("groups-*.json")):
                self._groups.update(json.loads(path.read_text()))
        return self._groups.get(nodeid, nodeid)


def _locked(path: Path, how: int) -> IO[bytes]:
    f = path.open("ab")
    try:
        fcntl.flock(f.fileno(), how)
    except BaseException:
        f.close()
        raise
    return f


@contextlib.contextmanager
def turn(directory: Path, alone: bool) -> Iterator[None]:
    """Run the block as one of the tests side by side, or `alone`: a readers-writer lock on
    two files in `directory` (one per run, shared by its workers). A test takes `gate` and
    lets go of it once it holds `running` shared; an `alone` test keeps `gate` while it waits
    for `running` exclusively, so that the tests starting meanwhile queue behind it instead
    of keeping it waiting for ever. A worker that dies lets go of its locks with it."""
    gate = _locked(directory / "gate.lock", fcntl.LOCK_EX)
    try:
        running = _locked(directory / "running.lock",
                          fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    except BaseException:
        gate.close()
        raise
    if not alone:
        gate.close()
    try:
        yield
    finally:
        running.close()
        if alone:
            gate.close()
