"""A time model as a file: saved and loaded through the file gate, every term checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline import PipeConfigError
from pipeline.planner import TimeModel
from pipeline.planner.time_model import machine
from schedules.files import FileRefused
from tests.other_user import other_user, run_as_other


def _saved(path: Path, **changes: object) -> Path:
    """A saved model with `changes`; a string "@1e999" is written as the bare number."""
    data = {"compute": 1.2, "contention": 1.1, "action": 1e-4, "message": 2e-5, "step": 1e-3,
            "allreduce": 1.0, "samples": 3, "machine": machine(), "rows": {}}
    path.write_text(json.dumps(data | changes).replace('"@1e999"', "1e999"))
    return path


def test_a_saved_model_loads(tmp_path: Path) -> None:
    assert TimeModel.load(_saved(tmp_path / "m.json")).compute == 1.2


@pytest.mark.timeout(30)  # a FIFO or /dev/zero used to be read forever
@pytest.mark.parametrize(("kind", "said"), [("fifo", "a FIFO"),
                                            ("link to /dev/zero", "a character device"),
                                            ("directory", "is a directory")])
def test_a_special_file_is_refused_without_waiting(tmp_path: Path, kind: str,
                                                   said: str) -> None:
    path = tmp_path / "m.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(PipeConfigError, match=rf"not a saved TimeModel \(.*{said}"):
        TimeModel.load(path)


@pytest.mark.timeout(30)
def test_json_nested_100k_deep_is_refused_by_its_depth(tmp_path: Path) -> None:
    """It raised RecursionError."""
    path = tmp_path / "m.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PipeConfigError, match=r"nests more than 4 arrays or objects deep"):
        TimeModel.load(path)


@pytest.mark.parametrize(("changes", "said"), [
    ({"compute": "@1e999"}, r"compute must be a finite number \(got inf\)"),
    ({"step": float("inf")}, r"holds Infinity, where a number must be finite"),
    ({"samples": "lots"}, r"samples must be a whole number >= 0 \(got 'lots'\)"),
    ({"samples": 2.5}, r"samples must be a whole number"),
    ({"action": "0.1"}, r"action must be a finite number \(got '0.1'\)"),
    ({"rows": {"8": "@1e999"}}, r"rows\[8\] must be a finite number"),
])
def test_terms_out_of_range_are_refused(tmp_path: Path, changes: dict[str, object],
                                        said: str) -> None:
    """`inf` terms and `samples = "lots"` used to load."""
    with pytest.raises(PipeConfigError, match=said):
        TimeModel.load(_saved(tmp_path / "m.json", **changes))


def test_a_file_too_large_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    with open(path, "wb") as f:
        f.truncate(1 << 30)
    with pytest.raises(PipeConfigError, match=r"holds 1073741824 bytes, more than the 1048576"):
        TimeModel.load(path)


@other_user
def test_a_link_another_user_planted_is_neither_saved_through_nor_loaded(
        shared_dir: str) -> None:
    """Saving through a planted link replaced our 0600 file with the model's JSON."""
    mine = Path(shared_dir) / "secret"
    mine.write_text("ours")
    mine.chmod(0o600)
    path = Path(shared_dir) / "time-model.json"
    done = run_as_other("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(mine),
                        str(path))
    assert done.returncode == 0, done.stderr
    with pytest.raises(FileRefused, match="symbolic link of another user"):
        TimeModel().save(path)
    assert mine.read_text() == "ours"
    with pytest.raises(PipeConfigError, match="symbolic link of another user"):
        TimeModel.load(path)
