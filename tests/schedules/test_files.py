"""`write_atomic`: a file holds its old content or the new, whole, whenever its writer dies."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from schedules import files
from schedules.files import FileRefused, read_file, resolve, write_atomic
from tests.other_user import other_user, run_as_other

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


# Another user tries to read every file in the directory while the new bytes are in the
# temporary file, synced but not yet renamed.
_READ_ALL = """
import os, sys
for name in sorted(os.listdir(sys.argv[1])):
    try:
        with open(os.path.join(sys.argv[1], name), "rb") as f:
            print(name, "read", len(f.read()))
    except PermissionError:
        print(name, "refused")
"""


@other_user
@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_a_private_files_new_bytes_are_never_readable_by_another_user(
        shared_dir: str, monkeypatch: pytest.MonkeyPatch, mode: int) -> None:
    # The temporary file was created 0644 and chmod-ed only after the write: another user
    # could open it then and read the new content after the rename.
    target = Path(shared_dir) / "secret.json"
    target.write_bytes(b"old")
    os.chmod(target, mode)
    seen = []
    fsync = os.fsync

    def fsync_then_look(fd: int) -> None:
        fsync(fd)
        if not seen:  # the temporary file's fsync (the directory's comes after the rename)
            seen.append(run_as_other(_READ_ALL, shared_dir).stdout.split("\n"))

    monkeypatch.setattr(os, "fsync", fsync_then_look)
    write_atomic(target, b"new secret")
    lines = [line for line in seen[0] if line]
    assert len(lines) == 2 and all(line.endswith("refused") for line in lines), lines
    assert target.read_bytes() == b"new secret"
    assert stat.S_IMODE(target.stat().st_mode) == mode


def test_a_new_files_mode_is_the_umasks_from_its_first_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    modes = []
    fsync = os.fsync

    def fsync_then_look(fd: int) -> None:
        fsync(fd)
        modes.extend(stat.S_IMODE(os.stat(p).st_mode) for p in tmp_path.iterdir())

    monkeypatch.setattr(os, "fsync", fsync_then_look)
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "new.txt", "x")
    finally:
        os.umask(old)
    assert modes and set(modes) == {0o600}, modes
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o600


# What another user does in a shared directory, before one of our writes or reads.
_PLANT_LINK = "import os, sys; os.symlink(sys.argv[1], sys.argv[2])"
_PLANT_FIFO = "import os, sys; os.mkfifo(sys.argv[1], 0o666)"


@other_user
@pytest.mark.timeout(30)
@pytest.mark.parametrize("pointed", ["ours", os.devnull])
def test_a_link_another_user_planted_is_never_written_through(shared_dir: str,
                                                               pointed: str) -> None:
    """A link planted in place of the file used to be followed: our 0600 file replaced by
    the new content, or a device written to."""
    mine = Path(shared_dir) / "mine.json"
    mine.write_bytes(b"secret")
    mine.chmod(0o600)
    out = Path(shared_dir) / "model.json"
    done = run_as_other(_PLANT_LINK, str(mine) if pointed == "ours" else pointed, str(out))
    assert done.returncode == 0, done.stderr
    with pytest.raises(FileRefused, match=r"symbolic link of another user \(uid 65534\)"):
        write_atomic(out, "{}")
    with pytest.raises(FileRefused, match="symbolic link of another user"):
        read_file(out, limit=100)
    assert mine.read_bytes() == b"secret" and out.is_symlink()
    assert sorted(os.listdir(shared_dir)) == ["mine.json", "model.json"]


@other_user
@pytest.mark.timeout(30)
def test_a_link_another_user_planted_above_the_file_is_not_followed(
        tmp_path: Path, shared_dir: str) -> None:
    (tmp_path / "ours").mkdir()
    done = run_as_other(_PLANT_LINK, str(tmp_path / "ours"), f"{shared_dir}/runs")
    assert done.returncode == 0, done.stderr
    with pytest.raises(FileRefused, match=r"'runs' is a symbolic link of another user"):
        write_atomic(Path(shared_dir) / "runs" / "out.csv", "a\n")
    assert os.listdir(tmp_path / "ours") == []


@other_user
@pytest.mark.timeout(30)
def test_a_fifo_another_user_planted_is_refused_without_waiting(shared_dir: str) -> None:
    out = Path(shared_dir) / "model.json"
    done = run_as_other(_PLANT_FIFO, str(out))
    assert done.returncode == 0, done.stderr
    with pytest.raises(FileRefused, match=r"belongs to another user \(uid 65534\)"):
        write_atomic(out, "{}")
    with pytest.raises(FileRefused, match=r"socket or FIFO|belongs to another user"):
        read_file(out, limit=100)


@pytest.mark.timeout(30)
def test_special_files_are_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FileRefused, match="FIFO nobody reads"):
        write_atomic(fifo, "x")
    with pytest.raises(FileRefused, match=r"socket or FIFO|a FIFO"):
        read_file(fifo, limit=100)
    with pytest.raises(FileRefused, match="a character device"):
        read_file("/dev/zero", limit=100)
    with pytest.raises(FileRefused, match="is a directory"):
        write_atomic(tmp_path, "x")
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(FileRefused, match="holds 101 bytes, more than the 100"):
        read_file(tmp_path / "big", limit=100)
    assert read_file(tmp_path / "big", limit=101) == b"x" * 101


def test_links_of_ours_are_followed_and_loops_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "up").symlink_to("real/../real")  # relative, through `..`
    write_atomic(tmp_path / "up" / "a.csv", "x")
    assert read_file(tmp_path / "real" / "a.csv", limit=10) == b"x"
    # Nothing below a missing directory exists, so no link either: the rest is taken by name.
    assert resolve(tmp_path / "up" / "new" / ".." / "x") == str(tmp_path / "real" / "x")
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(FileRefused, match="more than 40 symbolic links"):
        read_file(tmp_path / "loop", limit=10)


def test_standard_output_is_written_through_the_process_own_descriptor() -> None:
    """`pipeviz -o /dev/stdout | ...`: /dev/stdout is a link to /proc/self/fd/1, whose target
    is a pipe ("pipe:[...]"), no path to walk; a descriptor of the process's own, in a
    directory only it can write, is opened through the kernel and written directly."""
    code = "from schedules.files import write_atomic; write_atomic('/dev/stdout', 'a,b\\n')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, cwd=Path(__file__).parents[2])
    assert (done.returncode, done.stdout) == (0, "a,b\n"), done.stderr


def _directory(mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((stat.S_IFDIR | mode, 1, 1, 2, uid, gid, 4096, 0, 0, 0))


def test_a_directory_writable_by_the_owners_own_group_alone_is_not_shared() -> None:
    """A umask of 002 makes a user's directories 0775 in their own group (most
    distributions): a save into their project directory was refused as a shared one."""
    import grp
    import pwd

    me = pwd.getpwuid(os.getuid())
    own = grp.getgrgid(me.pw_gid)
    if own.gr_name != me.pw_name or set(own.gr_mem) - {me.pw_name}:
        pytest.skip(f"this user's primary group {own.gr_name!r} is not a group of its own")
    assert not files.shared(_directory(0o775, me.pw_uid, me.pw_gid))
    assert files.shared(_directory(0o757, me.pw_uid, me.pw_gid))  # others may write
    others = [g for g in grp.getgrall() if g.gr_gid != me.pw_gid]
    assert files.shared(_directory(0o775, me.pw_uid, others[0].gr_gid))  # a group of several
    assert not files.shared(_directory(0o755, me.pw_uid, others[0].gr_gid))


def test_private_directories_and_files_are_made_so_whatever_the_umask(tmp_path: Path) -> None:
    """A private store (the planner's remembered choices) asks for 0700 directories and 0600
    files; they were made 0755 and 0666 less the umask."""
    old = os.umask(0o002)
    try:
        fd = files.open_directory(tmp_path / "a" / "b", create=True, mode=0o700)
        try:
            files.write_in(fd, "f.json", b"{}", "f.json", mode=0o600)
        finally:
            os.close(fd)
        files.write_atomic(tmp_path / "a" / "b" / "f.json", b"[]", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
    made = tmp_path / "a" / "b" / "f.json"
    assert stat.S_IMODE(made.stat().st_mode) == 0o600 and made.read_bytes() == b"[]"
    made.chmod(0o644)  # a wider file of ours is narrowed when written with a mode
    files.write_atomic(made, b"{}", mode=0o600)
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
