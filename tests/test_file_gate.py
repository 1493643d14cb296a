"""Every file reader behind the gate, fed crafted files: only the documented errors, in time."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from torch import nn

from pipeline import PipeConfigError
from pipeline.planner import TimeModel, remembered
from pipeline.planner.time_model import MAX_FILE_BYTES
from pipeline.state import opened, sharded
from schedules import ScheduleError, load_csv
from schedules.csvio import MAX_CSV_BYTES
from schedules.files import FileRefused
from tests.strategies import gate_inputs

_SECONDS = 20.0  # per example: a reader that blocks or parses without bound fails here


def _load_checkpoint(path: Path) -> None:
    sharded.load(nn.Linear(2, 2), path.parent)


# reader -> (the file's name in its directory, what reads it, its size bound, its errors)
_READERS: dict[str, tuple[str, Callable[[Path], Any], int, tuple[type[Exception], ...]]] = {
    "checkpoint metadata": (".metadata", _load_checkpoint, opened.MAX_METADATA_BYTES,
                            (PipeConfigError,)),
    "time model": ("model.json", TimeModel.load, MAX_FILE_BYTES, (PipeConfigError,)),
    # A missing file is the caller's to name: load_csv raises what open() would.
    "schedule csv": ("s.csv", load_csv, MAX_CSV_BYTES,
                     (ScheduleError, FileRefused, FileNotFoundError)),
    # A remembered choice is never trusted and never fatal: refused or damaged, it is ignored
    # with a warning and the plan chosen afresh, so no error at all is documented.
    "plan memory": ("last.json", remembered.load, remembered.MAX_FILE_BYTES, ()),
}


def _content(crafted: dict[str, Any]) -> bytes:
    depth = crafted["depth"]
    if crafted["kind"] == "deep" and crafted["reader"] == "checkpoint metadata":
        return b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."  # pickle's nested lists
    if crafted["kind"] == "deep":
        return ("[" * depth + "0," * 3 + "]" * depth).encode()
    return crafted["text"].encode() if crafted["kind"] == "text" else crafted["data"]


def _build(root: Path, crafted: dict[str, Any]) -> Path:
    """`root/a/b/<name>` as `crafted` says; the path the reader is given."""
    name, _, limit, _ = _READERS[crafted["reader"]]
    real = root / "real"
    (real / "b").mkdir(parents=True)
    path = root / "a" / "b" / name
    if crafted["kind"] == "linked component" and crafted["component"] == 0:
        (root / "a").symlink_to(real)  # ours, in our own directory: followed
    else:
        (root / "a").mkdir()
        if crafted["kind"] == "linked component":
            (root / "a" / "b").symlink_to(real / "b")
        else:
            (root / "a" / "b").mkdir()
    kind = crafted["kind"]
    if kind in ("text", "bytes", "deep", "linked component"):
        path.write_bytes(_content(crafted))
    elif kind == "large":
        with open(path, "wb") as f:
            f.truncate(limit + 1)  # sparse: nothing is written
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "device link":
        path.symlink_to("/dev/zero")
    elif kind == "dangling link":
        path.symlink_to(root / "nowhere")
    else:  # a loop
        path.symlink_to(path)
    return path


@pytest.mark.timeout(600)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(crafted=gate_inputs())
def test_every_reader_raises_only_its_documented_errors_in_time(crafted: dict[str, Any]
                                                                ) -> None:
    _, read, _, errors = _READERS[crafted["reader"]]
    with tempfile.TemporaryDirectory() as scratch:
        path = _build(Path(scratch), crafted)
        started = time.monotonic()
        with contextlib.suppress(*errors):  # anything else fails the test
            read(path)
        assert time.monotonic() - started < _SECONDS, crafted
