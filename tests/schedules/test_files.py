"""`write_atomic`: a file holds its old content or the new, whole, whenever its writer dies."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from schedules.files import write_atomic

ROOT = Path(__file__).resolve().parents[2]

# A writer killed (SIGKILL) at a point of write_atomic: the helper's own calls are patched in a
# fresh interpreter (no torch), so each run takes a fraction of a second.
_KILLED_AT = """
import os, signal, sys
from schedules import files

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

point, path = sys.argv[1], sys.argv[2]
fsync, replace = os.fsync, os.replace
if point == "fsync":            # the temporary file written, not yet synced
    os.fsync = die
elif point == "before-replace":
    os.replace = die
else:                           # renamed into place, the directory not yet synced
    def replaced(*args, **kwargs):
        replace(*args, **kwargs)
        die()
    os.replace = replaced
files.write_atomic(path, b"new " * 100_000)
"""


@pytest.mark.parametrize(("point", "expected"), [("fsync", "old"), ("before-replace", "old"),
                                                 ("after-replace", "new")])
def test_a_writer_killed_part_way_leaves_the_old_or_the_new_file(
        tmp_path: Path, point: str, expected: str) -> None:
    target = tmp_path / "results.json"
    target.write_bytes(b"old " * 50)
    proc = subprocess.run([sys.executable, "-c", _KILLED_AT, point, str(target)], cwd=ROOT,
                          capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    assert target.read_bytes() == {"old": b"old " * 50, "new": b"new " * 100_000}[expected]


def test_text_and_bytes_replace_the_file_keeping_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "out.csv"
    write_atomic(target, "a,b\nc\n")
    assert target.read_bytes() == b"a,b\nc\n"  # utf-8, no newline translation
    os.chmod(target, 0o640)
    write_atomic(target, b"\x89PNG")
    assert target.read_bytes() == b"\x89PNG"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["out.csv"]


def test_a_link_is_followed_and_a_device_written_directly(tmp_path: Path) -> None:
    real = tmp_path / "real.svg"
    real.write_text("old")
    link = tmp_path / "link.svg"
    link.symlink_to(real)
    write_atomic(link, "<svg/>")
    assert link.is_symlink() and real.read_text() == "<svg/>"
    write_atomic(os.devnull, "discarded")  # nothing can be renamed onto a device


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "report.md"
    target.write_text("old")

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["report.md"]
