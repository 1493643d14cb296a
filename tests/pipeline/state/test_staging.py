"""Checkpoint directories swapped in whole: the staging, recovery and clean-up rules, in one
process (tests/pipeline/state/test_sharded_crash.py kills ranks part-way through real saves)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import PipeConfigError, PipelineError
from pipeline.state import sharded, staging
from tests.pipeline.sharded_workers import adam, assert_same, model, snapshot, train_step


def _saved(path: Path, seed: int) -> dict[str, object]:
    plain = model(seed)
    optimizer = adam(plain)
    train_step(plain, optimizer, 0)
    sharded.save(plain, path, optimizer)
    return snapshot(plain, optimizer)


def _loaded(path: Path) -> dict[str, object]:
    target = model(9)
    optimizer = adam(target, lr=0.5)
    sharded.load(target, path, optimizer)
    return snapshot(target, optimizer)


def test_a_save_replaces_the_checkpoint_and_leaves_no_siblings(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _saved(path, seed=0)
    second = _saved(path, seed=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert staging.MARKER in os.listdir(path)
    assert_same(_loaded(path), second, "the second save")


def test_leftovers_of_this_checkpoint_are_cleaned_and_nothing_else(tmp_path: Path) -> None:
    token = staging.new_token()
    leftovers = [f"ckpt.tmp-{token}", f"ckpt.old-{token}"]
    kept = ["ckpt.tmp-notes", f"other.tmp-{token}", f"ckpt2.tmp-{token}"]
    for name in leftovers + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.distcp").write_bytes(b"half")
    _saved(tmp_path / "ckpt/", seed=0)  # a trailing separator names the same directory
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *kept])


def test_between_the_renames_the_newest_complete_staged_checkpoint_loads(tmp_path: Path) -> None:
    """`ckpt` missing: a staged sibling counts only with its marker; the newest one wins."""
    path = tmp_path / "ckpt"
    older, newer, unmarked = staging.new_token(), staging.new_token(), staging.new_token()
    expected = _saved(tmp_path / "b", seed=2)
    _saved(tmp_path / "a", seed=1)
    (tmp_path / "a").rename(staging.staged_path(path, older))
    (tmp_path / "b").rename(staging.staged_path(path, newer))
    _saved(tmp_path / "c", seed=3)
    os.remove(tmp_path / "c" / staging.MARKER)
    (tmp_path / "c").rename(staging.staged_path(path, unmarked))
    assert staging.resolve(path) == staging.staged_path(path, newer)
    with pytest.warns(UserWarning, match=r"is missing .* loading the complete new checkpoint"):
        assert_same(_loaded(path), expected, "the newest complete staged checkpoint")
    os.remove(Path(staging.staged_path(path, newer)) / staging.MARKER)
    os.remove(Path(staging.staged_path(path, older)) / staging.MARKER)
    assert staging.resolve(path) == os.fspath(path)  # no complete one: nothing is read
    with pytest.raises(PipeConfigError, match=r"nothing to load at .*ckpt'.*no \.metadata"):
        _loaded(path)


def test_a_save_replaces_only_a_checkpoint_or_an_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _saved(tmp_path / "empty", seed=0)  # an empty directory may be replaced
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.txt").write_text("mine")
    with pytest.raises(PipeConfigError, match=r"holds files that are not a checkpoint's "
                                              r"\(\['README.txt'\]\).*save to a new or empty"):
        _saved(notes, seed=0)
    assert os.listdir(notes) == ["README.txt"]
    (tmp_path / "file").write_text("mine")
    with pytest.raises(PipeConfigError, match="exists and is not a directory"):
        _saved(tmp_path / "file", seed=0)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_link_to_a_checkpoint_keeps_pointing_at_the_new_one(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    _saved(link, seed=0)
    second = _saved(link, seed=1)
    assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert_same(_loaded(tmp_path / "real"), second, "through the link")


def test_a_failed_write_leaves_the_checkpoint_and_no_staged_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    first = _saved(path, seed=0)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharded, "dcp_save", broken)
    with pytest.raises(PipelineError, match=r"ckpt' is unchanged: writing failed: "
                                                     r"OSError: .*No space left"):
        _saved(path, seed=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_same(_loaded(path), first, "the checkpoint before the failed save")


def test_a_failed_swap_is_raised_and_the_old_checkpoint_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    first = _saved(path, seed=0)
    real_rename = os.rename

    def refused(source: str, destination: str) -> None:
        if ".old-" in os.fspath(destination):  # the swap's first rename
            raise PermissionError(13, "Permission denied")
        real_rename(source, destination)

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(PipelineError, match=r"swapping the new checkpoint in at .*ckpt' failed "
                                             r".*PermissionError"):
        _saved(path, seed=1)
    monkeypatch.undo()
    assert_same(_loaded(path), first, "the checkpoint the swap did not replace")
    second = _saved(path, seed=1)  # the next save clears the staged one the failure left
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_same(_loaded(path), second, "the next save")
