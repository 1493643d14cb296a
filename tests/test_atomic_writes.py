"""Every file a user relies on is written whole or not at all: each writer goes through
`schedules.files.write_atomic` (tests/schedules/test_files.py kills a writer part-way)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import schedules
from benchmarks.cli import write_outputs
from benchmarks.records import build_records
from tests.benchmarks import fakes
from viz import main, write_png


def _csv(path: Path) -> None:
    schedules.dump_csv(schedules.get_schedule("1f1b", num_ranks=2, num_microbatches=2), path)


def _cli(*argv: str) -> None:
    """pipeviz: exit status 2 and one line on stderr when it cannot write."""
    if main(list(argv)) != 0:
        raise OSError("pipeviz failed")


def _pipeviz(path: Path) -> None:
    _cli("1f1b", "-p", "2", "-m", "2", "-o", str(path))


def _png(path: Path) -> None:
    write_png(schedules.get_schedule("gpipe", num_ranks=2, num_microbatches=2), path)


def _plan(path: Path) -> None:
    _cli("plan", "pipeline.examples.models:MODELS.tiny", "--ranks", "2", "--chunks", "1",
         "--schedules", "1f1b", "--threads", "1", "-o", str(path))


def _benchmark(path: Path) -> None:
    g = fakes.group(2)
    records = [r for r, _ in build_records(g, {4: fakes.measured(g, 4)}, fakes.ENV)]
    write_outputs(path.parent, records, {}, fakes.ENV, suite="quick", command="cmd", plots=False)


@pytest.mark.parametrize(("writer", "name"), [
    (_csv, "schedule.csv"), (_pipeviz, "grid.svg"), (_png, "grid.png"), (_plan, "plan.svg"),
    (_benchmark, "results.jsonl"),
])
def test_a_writer_that_fails_before_its_rename_leaves_the_old_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: Callable[[Path], None],
        name: str) -> None:
    """(The files written are checked in tests/viz and tests/benchmarks.)"""
    target = tmp_path / name
    target.write_text("old")
    renamed: list[str] = []

    def refused(source: str, destination: str, **_: object) -> None:  # an atomic write's last step
        renamed.append(os.path.basename(destination))
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError):
        writer(target)
    assert name in renamed  # the file was written beside, then was to be renamed into place
    assert target.read_text() == "old" and not list(tmp_path.glob(".*.tmp"))
