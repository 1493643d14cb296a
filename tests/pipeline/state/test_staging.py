"""Checkpoint directories swapped in whole: the staging, recovery and clean-up rules, in one
process (tests/pipeline/state/test_sharded_crash.py kills ranks part-way through real saves)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipeline import PipeConfigError, PipelineError
from pipeline.state import sharded, staging
from tests.other_user import other_user, run_as_other
from tests.pipeline.sharded_workers import (
    assert_same,
    load_fresh,
    save_trained,
)


def test_a_save_replaces_the_checkpoint_and_leaves_no_siblings(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_trained(path, seed=0)
    second = save_trained(path, seed=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert staging.MARKER in os.listdir(path)
    assert_same(load_fresh(path), second, "the second save")


def test_leftovers_of_this_checkpoint_are_cleaned_and_nothing_else(tmp_path: Path) -> None:
    token = staging.new_token(tmp_path / "ckpt")
    leftovers = [f"ckpt.tmp-{token}", f"ckpt.old-{token}"]
    kept = ["ckpt.tmp-notes", f"other.tmp-{token}", f"ckpt2.tmp-{token}"]
    for name in leftovers + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.distcp").write_bytes(b"half")
    save_trained(tmp_path / "ckpt/", seed=0)  # a trailing separator names the same directory
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *kept])


def test_between_the_renames_the_newest_complete_staged_checkpoint_loads(tmp_path: Path) -> None:
    """`ckpt` missing and no save had begun its swap (there was no `ckpt`): a staged sibling
    counts only with its marker; the greatest generation wins."""
    path = tmp_path / "ckpt"
    older, newer, unmarked = (f"{g:016x}-0000000{g}" for g in (1, 2, 3))
    expected = save_trained(tmp_path / "b", seed=2)
    save_trained(tmp_path / "a", seed=1)
    (tmp_path / "a").rename(staging.staged_path(path, older))
    (tmp_path / "b").rename(staging.staged_path(path, newer))
    save_trained(tmp_path / "c", seed=3)
    os.remove(tmp_path / "c" / staging.MARKER)
    (tmp_path / "c").rename(staging.staged_path(path, unmarked))
    assert staging.resolve(path) == staging.staged_path(path, newer)
    with pytest.warns(UserWarning, match=r"is missing .* loading the complete new checkpoint"):
        assert_same(load_fresh(path), expected, "the newest complete staged checkpoint")
    os.remove(Path(staging.staged_path(path, newer)) / staging.MARKER)
    os.remove(Path(staging.staged_path(path, older)) / staging.MARKER)
    assert staging.resolve(path) == os.fspath(path)  # no complete one: nothing is read
    with pytest.raises(PipeConfigError, match=r"nothing to load at .*ckpt'.*no \.metadata"):
        load_fresh(path)


def test_a_save_replaces_only_a_checkpoint_or_an_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    save_trained(tmp_path / "empty", seed=0)  # an empty directory may be replaced
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.txt").write_text("mine")
    with pytest.raises(PipeConfigError, match=r"holds files that are not a checkpoint's "
                                              r"\(\['README.txt'\]\).*save to a new or empty"):
        save_trained(notes, seed=0)
    assert os.listdir(notes) == ["README.txt"]
    (tmp_path / "file").write_text("mine")
    with pytest.raises(PipeConfigError, match="exists and is not a directory"):
        save_trained(tmp_path / "file", seed=0)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_link_to_a_checkpoint_keeps_pointing_at_the_new_one(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    save_trained(link, seed=0)
    second = save_trained(link, seed=1)
    assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert_same(load_fresh(tmp_path / "real"), second, "through the link")


def test_a_failed_write_leaves_the_checkpoint_and_no_staged_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    first = save_trained(path, seed=0)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharded, "dcp_save", broken)
    with pytest.raises(PipelineError, match=r"ckpt' is unchanged: writing failed: "
                                                     r"OSError: .*No space left"):
        save_trained(path, seed=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_same(load_fresh(path), first, "the checkpoint before the failed save")


def test_a_failed_swap_is_raised_and_the_old_checkpoint_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    first = save_trained(path, seed=0)
    real_rename = os.rename

    def refused(source: str, destination: str, **held: int) -> None:
        if ".old-" in os.fspath(destination):  # the swap's first rename
            raise PermissionError(13, "Permission denied")
        real_rename(source, destination, **held)

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(PipelineError, match=r"swapping the new checkpoint in at .*ckpt' failed "
                                             r".*PermissionError"):
        save_trained(path, seed=1)
    monkeypatch.undo()
    assert_same(load_fresh(path), first, "the checkpoint the swap did not replace")
    second = save_trained(path, seed=1)  # the next save clears the staged one the failure left
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_same(load_fresh(path), second, "the next save")


# -- commit order, ownership, modes, one saver ---------------------------------------------------
def _staged_copy(source: Path, path: Path, token: str, kind: str = "tmp") -> str:
    """`source`'s checkpoint moved to the sibling `path.<kind>-<token>` of `path`."""
    staged = staging.staged_path(path, token, kind)
    source.rename(staged)
    return staged


def test_the_save_that_was_mid_swap_wins_whatever_the_clocks(tmp_path: Path) -> None:
    """S was killed after `.complete` and before its first rename, its token greater (a clock
    ahead); T was killed between its renames. T is the one that replaced `ckpt`: it loads."""
    path = tmp_path / "ckpt"
    save_trained(path, seed=0)  # the checkpoint both saves replace
    skewed, later = "ffffffff00000000-00000001", "0000000000000002-00000002"
    save_trained(tmp_path / "s", seed=1)
    _staged_copy(tmp_path / "s", path, skewed)  # S: complete, never renamed anything
    expected = save_trained(tmp_path / "t", seed=2)
    _staged_copy(tmp_path / "t", path, later)
    path.rename(staging.staged_path(path, later, "old"))  # T's first rename, then T died
    assert staging.resolve(path) == staging.staged_path(path, later)
    with pytest.warns(UserWarning, match="cut short between its two renames"):
        assert_same(load_fresh(path), expected, "the save that was mid-swap")


def test_tokens_count_generations_not_time(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    save_trained(path, seed=0)
    first = (path / staging.MARKER).read_text().split("-")[0]
    monkeypatch.setattr("time.time_ns", lambda: 0)  # a clock that went back
    save_trained(path, seed=1)
    second = (path / staging.MARKER).read_text().split("-")[0]
    assert int(second, 16) == int(first, 16) + 1


def test_a_directory_or_link_named_like_a_shard_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_trained(path, seed=0)
    (path / "old-run.distcp").mkdir()
    (path / "old-run.distcp" / "notes.txt").write_text("mine")
    with pytest.raises(PipeConfigError, match=r"not a checkpoint's \(\['old-run\.distcp'\]\)"):
        save_trained(path, seed=1)
    assert (path / "old-run.distcp" / "notes.txt").read_text() == "mine"
    (path / "old-run.distcp" / "notes.txt").unlink()
    (path / "old-run.distcp").rmdir()
    (tmp_path / "mine.txt").write_text("mine")
    (path / "link.distcp").symlink_to(tmp_path / "mine.txt")
    with pytest.raises(PipeConfigError, match=r"not a checkpoint's \(\['link\.distcp'\]\)"):
        save_trained(path, seed=1)
    assert (tmp_path / "mine.txt").read_text() == "mine"


def _modes(path: Path) -> tuple[int, set[int]]:
    return (path.stat().st_mode & 0o7777,
            {p.lstat().st_mode & 0o7777 for p in path.iterdir()})


def test_a_private_checkpoint_stays_private(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_trained(path, seed=0)
    path.chmod(0o700)
    for p in path.iterdir():
        p.chmod(0o600)
    old = os.umask(0o022)
    try:
        save_trained(path, seed=1)
    finally:
        os.umask(old)
    assert _modes(path) == (0o700, {0o600})


@pytest.mark.parametrize(("umask", "expected"), [(0o077, (0o700, {0o600})),
                                                 (0o022, (0o755, {0o644})),
                                                 (0o002, (0o755, {0o664}))])
def test_a_new_checkpoint_takes_the_umask_less_write_for_others(
        tmp_path: Path, umask: int, expected: tuple[int, set[int]]) -> None:
    """No group or other write on the directory even under umask 002: load refuses those."""
    old = os.umask(umask)
    try:
        save_trained(tmp_path / "ckpt", seed=0)
    finally:
        os.umask(old)
    assert _modes(tmp_path / "ckpt") == expected
    load_fresh(tmp_path / "ckpt")


def test_a_directory_others_can_write_is_refused_on_load(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_trained(path, seed=0)
    path.chmod(0o777)
    with pytest.raises(PipeConfigError, match=r"writable by other users \(mode 0o777\).*chmod "
                                              r"go-w"):
        load_fresh(path)


def test_two_saves_at_once_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    first = save_trained(path, seed=0)
    with (staging.save_lock(path),  # another save is running
          pytest.raises(PipeConfigError, match=r"another save of .*ckpt' is running")):
        save_trained(path, seed=1)
    assert_same(load_fresh(path), first, "the checkpoint the refused save left")
    save_trained(path, seed=2)  # the lock was released: saves go on
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# -- another user beside the job -----------------------------------------------------------------
_READ = """
import sys
try:
    with open(sys.argv[1], "rb") as f:
        print("read", len(f.read()))
except OSError as exc:
    print("refused", type(exc).__name__)
"""


@other_user
def test_another_user_never_reads_a_private_checkpoint_while_it_is_saved(
        tmp_path: Path, shared_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(shared_dir) / "ckpt"
    save_trained(path, seed=0)
    path.chmod(0o700)
    for p in path.iterdir():
        p.chmod(0o600)
    seen: list[str] = []
    dcp_save = sharded.dcp_save  # type: ignore[attr-defined]

    def watched(*args: object, **kwargs: object) -> None:
        dcp_save(*args, **kwargs)  # the shard is written, not yet swapped in
        for shard in Path(shared_dir).glob("ckpt.tmp-*/*.distcp"):
            seen.append(run_as_other(_READ, str(shard)).stdout.strip())

    monkeypatch.setattr(sharded, "dcp_save", watched)
    save_trained(path, seed=1)
    assert seen and all(s.startswith("refused") for s in seen), seen
    (shard,) = path.glob("*.distcp")
    assert run_as_other(_READ, str(shard)).stdout.startswith("refused")
    assert _modes(path) == (0o700, {0o600})


_PLANT = """
import os, shutil, sys
source, staged = sys.argv[1], sys.argv[2]
shutil.copytree(source, staged)
with open(os.path.join(staged, ".complete"), "w") as f:
    f.write(os.path.basename(staged).split(".tmp-")[1] + "\\n")
print(os.stat(staged).st_uid)
"""


def _readable_copy(source: Path, where: Path) -> Path:
    """A copy of checkpoint `source` that anyone may read (what the other user plants)."""
    shutil.copytree(source, where)
    where.chmod(0o755)
    for p in where.iterdir():
        p.chmod(0o644)
    return where


@other_user
def test_a_staged_directory_another_user_planted_is_never_read(tmp_path: Path,
                                                                shared_dir: str) -> None:
    path = Path(shared_dir) / "ckpt"
    save_trained(tmp_path / "theirs", seed=5)
    theirs = _readable_copy(tmp_path / "theirs", Path(shared_dir) / "theirs-src")
    planted = staging.staged_path(path, "ffffffffffffffff-00000000")
    done = run_as_other(_PLANT, str(theirs), planted)
    assert done.stdout.strip() == "65534", done.stderr
    # Nothing of ours there: the planted one is not a checkpoint of `ckpt`.
    assert staging.resolve(path) == os.fspath(path)
    with pytest.raises(PipeConfigError, match=r"nothing to load at .*no \.metadata"):
        load_fresh(path)
    # A save of ours goes on beside it (its generation does not count), and a crash of the next
    # one between its renames loads ours, not the planted one.
    save_trained(path, seed=0)
    expected = save_trained(tmp_path / "b", seed=1)
    token = staging.new_token(path)
    _staged_copy(tmp_path / "b", path, token)
    path.rename(staging.staged_path(path, token, "old"))
    assert staging.resolve(path) == staging.staged_path(path, token)
    with pytest.warns(UserWarning, match="cut short between its two renames"):
        assert_same(load_fresh(path), expected, "ours, not the planted one")
    save_trained(path, seed=2)  # the clean-up leaves the other user's directory alone
    assert os.path.isdir(planted)


_PLANT_TARGET = """
import os, shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2])
os.chmod(sys.argv[2], 0o755)
"""


@other_user
def test_a_checkpoint_another_user_planted_at_the_path_is_refused(tmp_path: Path,
                                                                 shared_dir: str) -> None:
    """`ckpt` is missing between a save's renames: another user may create it in a directory
    anyone can write to. Such a directory is refused, not loaded."""
    save_trained(tmp_path / "theirs", seed=5)
    theirs = _readable_copy(tmp_path / "theirs", Path(shared_dir) / "theirs-src")
    path = Path(shared_dir) / "ckpt"
    done = run_as_other(_PLANT_TARGET, str(theirs), str(path))
    assert done.returncode == 0, done.stderr
    with pytest.raises(PipeConfigError, match=r"belongs to another user \(uid 65534\) and lies "
                                              r"in a directory others may write"):
        load_fresh(path)


# The other user keeps a checkpoint of theirs in a directory of their own (not one anyone may
# write: a load would refuse it there), then links the path we load and save to it.
_PLANT_LINK = """
import os, shutil, sys
source, home, link = sys.argv[1], sys.argv[2], sys.argv[3]
os.mkdir(home, 0o755)
shutil.copytree(source, os.path.join(home, "ckpt"))
os.chmod(os.path.join(home, "ckpt"), 0o755)
os.symlink(os.path.join(home, "ckpt") if sys.argv[4] == "theirs" else sys.argv[4], link)
"""


@other_user
@pytest.mark.parametrize("pointed", ["theirs", "our older checkpoint"])
def test_a_link_another_user_planted_at_the_path_is_neither_loaded_nor_saved_through(
        tmp_path: Path, shared_dir: str, pointed: str) -> None:
    """On a first start, or between a save's renames, `ckpt` may be missing: another user
    links it to their checkpoint (their weights, loaded without a word; a save wrote into
    their directory) or to an older one of ours (a silent rollback)."""
    save_trained(tmp_path / "theirs", seed=5)
    theirs = _readable_copy(tmp_path / "theirs", Path(shared_dir) / "theirs-src")
    older = tmp_path / "older"
    save_trained(older, seed=1)
    home, path = Path(shared_dir) / "home", Path(shared_dir) / "ckpt"
    target = "theirs" if pointed == "theirs" else str(older)
    done = run_as_other(_PLANT_LINK, str(theirs), str(home), str(path), target)
    assert done.returncode == 0, done.stderr
    before = sorted(os.listdir(home / "ckpt"))
    with pytest.raises(PipeConfigError, match=r"'ckpt' is a symbolic link of another user "
                                              r"\(uid 65534\).*not followed"):
        load_fresh(path)
    with pytest.raises(PipeConfigError, match=r"symbolic link of another user"):
        save_trained(path, seed=0)
    assert sorted(os.listdir(home / "ckpt")) == before and path.is_symlink()
    assert not [n for n in os.listdir(shared_dir) if ".tmp-" in n or n.endswith(".lock")]


def test_a_checkpoint_named_like_the_lock_file_is_kept_and_named(tmp_path: Path) -> None:
    """A checkpoint of ours named `h.lock` blocked saving `h`, and the error said to remove
    it."""
    save_trained(tmp_path / "h.lock", seed=0)
    with pytest.raises(PipeConfigError, match=r"h\.lock' is a directory.*it is left alone: "
                                              r"move it, or save under another name") as err:
        save_trained(tmp_path / "h", seed=1)
    assert "remove it" not in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["h.lock"]
