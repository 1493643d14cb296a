"""A save writes only where it opened: its staged directory swapped for a link while it saves,
and directories in which others may rename a save's entries (refused)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import PipeConfigError, PipelineError
from pipeline.state import save_dirs, sharded
from tests.other_user import other_user, start_as_other
from tests.pipeline.sharded_workers import assert_same, load_fresh, save_trained


def _contents(directory: Path) -> dict[str, bytes]:
    """Every regular file of `directory` by name, with its bytes."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# -- the staged directory's name swapped between the gate's check and the writes ---------------
@pytest.mark.parametrize("pointed", ["another directory", "another checkpoint of ours"])
def test_a_staged_directory_swapped_for_a_link_mid_save_writes_nothing_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pointed: str) -> None:
    """Right after the staged directory is made (and before DCP writes a byte), its name is
    renamed away and linked to another directory: the shards and `.metadata` used to land
    there, and a link to another checkpoint of ours had it replaced by this model."""
    path = tmp_path / "ckpt"
    first = save_trained(path, seed=0)
    if pointed == "another directory":
        elsewhere = tmp_path / "theirs"
        elsewhere.mkdir(mode=0o777)
        expected: dict[str, object] = {}
    else:
        elsewhere = tmp_path / "other"
        other = save_trained(elsewhere, seed=7)
        expected = _contents(elsewhere)
    dcp_save = sharded.dcp_save  # type: ignore[attr-defined]
    swapped: list[str] = []

    def swap_then_save(*args: object, **kwargs: object) -> None:
        (staged,) = tmp_path.glob("ckpt.tmp-*")
        staged.rename(tmp_path / "moved-away")
        staged.symlink_to(elsewhere)
        swapped.append(staged.name)
        dcp_save(*args, **kwargs)

    monkeypatch.setattr(sharded, "dcp_save", swap_then_save)
    with pytest.raises(PipelineError, match=r"staged directory .*ckpt\.tmp-.* was replaced "
                                            r"while the save wrote into it"):
        save_trained(path, seed=1)
    monkeypatch.undo()
    assert swapped
    assert _contents(elsewhere) == expected, "the save wrote where the staged name pointed"
    if pointed != "another directory":
        assert_same(load_fresh(elsewhere), other, "the other checkpoint")
    assert (tmp_path / swapped[0]).is_symlink()  # the link is never renamed into place
    assert not path.is_symlink()
    assert_same(load_fresh(path), first, "the checkpoint the save did not replace")
    assert os.listdir(tmp_path / "moved-away") == []  # what it wrote is not left lying about
    third = save_trained(path, seed=3)  # the next save goes on
    assert_same(load_fresh(path), third, "the next save")


# -- directories whose entries others may rename --------------------------------------------------
@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_save_into_a_directory_others_may_rename_in_is_refused(tmp_path: Path,
                                                                  mode: int) -> None:
    """In a directory others may write without the sticky bit, they may rename any entry of
    ours: a save there is refused up front, naming the rule, the directory, its mode and the
    fix; with the sticky bit it goes on."""
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(mode)
    if not mode & 0o002:  # writable by its group: one of other users, not the owner's own
        if os.geteuid() != 0:
            pytest.skip("giving a directory a group of other users needs root")
        os.chown(team, -1, 65534)
    path = team / "ckpt"
    with pytest.raises(PipeConfigError, match=(
            rf"cannot save to .*ckpt'.*'{team}' is writable by other users without the sticky "
            rf"bit \(mode {mode:#o}\).*rename .*chmod \+t '{team}'.*only you can write")):
        save_trained(path, seed=0)
    assert os.listdir(team) == []  # refused before anything was made there
    team.chmod(mode | 0o1000)
    saved = save_trained(path, seed=0)
    team.chmod(mode)  # a checkpoint already there is left as it is
    with pytest.raises(PipeConfigError, match="without the sticky bit"):
        save_trained(path, seed=1)
    assert sorted(os.listdir(team)) == ["ckpt"]
    assert_same(load_fresh(path), saved, "the checkpoint the refused save left")


def test_a_directory_writable_by_the_owners_own_group_alone_takes_saves(tmp_path: Path) -> None:
    """A umask of 002 (most distributions' default for users) makes a project directory 0775
    in the user's own group: nobody else may rename there, so a save goes on."""
    import grp
    import pwd

    me = pwd.getpwuid(os.getuid())
    group = grp.getgrgid(me.pw_gid)
    if group.gr_name != me.pw_name or set(group.gr_mem) - {me.pw_name}:
        pytest.skip(f"this user's primary group {group.gr_name!r} is not a group of its own")
    own = tmp_path / "project"
    own.mkdir()
    os.chown(own, -1, me.pw_gid)
    own.chmod(0o775)
    saved = save_trained(own / "ckpt", seed=0)
    assert_same(load_fresh(own / "ckpt"), saved, "the checkpoint saved")


def test_a_directory_others_may_rename_in_above_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """Above the checkpoint's own directory, a renamed directory moves the whole save: another
    of ours put in its place would have its checkpoint replaced."""
    team, mine = tmp_path / "team", tmp_path / "team" / "alice" / "run"
    mine.mkdir(parents=True)
    team.chmod(0o777)
    with pytest.raises(PipeConfigError, match=rf"'{team}' is writable by other users without "
                                              rf"the sticky bit \(mode 0o777\)"):
        save_trained(mine / "ckpt", seed=0)
    assert os.listdir(mine) == []


def test_directories_a_save_makes_grant_no_write_to_others(tmp_path: Path) -> None:
    """Under umask 002 the parents a save creates (as DCP would) would be group-writable, and
    the save would refuse them: they are made without write for group or others."""
    old = os.umask(0o002)
    try:
        save_trained(tmp_path / "runs" / "a" / "ckpt", seed=0)
    finally:
        os.umask(old)
    for made in (tmp_path / "runs", tmp_path / "runs" / "a"):
        assert made.stat().st_mode & 0o7777 == 0o755


# -- another user swapping the staged directory in a loop while saves run ----------------------
# Whenever a staged directory of the saver shows up, rename it away and link its name to
# `pointed` (their directory, or another checkpoint of the saver's); count the swaps.
_SWAPPER = """
import os, sys, time
parent, pointed, stop = sys.argv[1], sys.argv[2], sys.argv[3]
swaps = 0
while not os.path.exists(stop):
    for name in os.listdir(parent):
        if ".tmp-" not in name:
            continue
        try:
            if os.path.islink(os.path.join(parent, name)):
                continue
            os.rename(os.path.join(parent, name), os.path.join(parent, f"moved-{swaps}"))
            os.symlink(pointed, os.path.join(parent, name))
            swaps += 1
        except OSError:
            pass
print(swaps)
"""


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A directory anyone may write, without the sticky bit (0777), as a team's or a badly
    made scratch directory is."""
    path = Path(tempfile.mkdtemp(prefix="pipeline-open-", dir="/tmp"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", os.fspath(path)], check=False)


@other_user
@pytest.mark.parametrize("guard", ["as shipped", "without the up-front refusal"])
@pytest.mark.parametrize("pointed", ["theirs", "another checkpoint of ours"])
def test_another_user_swapping_the_staged_directory_in_a_loop_gets_nothing(
        tmp_path: Path, open_parent: Path, monkeypatch: pytest.MonkeyPatch, guard: str,
        pointed: str) -> None:
    """Saves in a loop in a 0777 directory while another user swaps each staged directory for
    a link to theirs (their copy of our shards) or to another checkpoint of ours (replaced).
    As shipped every save is refused up front; without that refusal the saves still write
    nothing of ours there and replace no other checkpoint (they fail, or succeed in place)."""
    theirs = open_parent / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 65534, 65534)
    other = tmp_path / "other"
    other_snapshot = save_trained(other, seed=7)
    other_files = _contents(other)
    target = theirs if pointed == "theirs" else other
    if guard != "as shipped":
        monkeypatch.setattr(save_dirs, "refuse_renamable", lambda *args: None)
    dcp_save = sharded.dcp_save  # type: ignore[attr-defined]

    def slow_save(*args: object, **kwargs: object) -> None:
        time.sleep(0.05)  # the staged directory stands a while before the writes, as on a busy disk
        dcp_save(*args, **kwargs)

    monkeypatch.setattr(sharded, "dcp_save", slow_save)
    stop = open_parent / "stop"  # where the other user can see it
    swapper = start_as_other(_SWAPPER, os.fspath(open_parent), os.fspath(target), os.fspath(stop))
    outcomes: list[str] = []
    try:
        time.sleep(0.3)  # the other interpreter is up
        for seed in range(8):
            try:
                save_trained(open_parent / "ckpt", seed=seed)
                outcomes.append("saved")
            except (PipeConfigError, PipelineError) as exc:
                outcomes.append(str(exc))
    finally:
        stop.touch()
        out, err = swapper.communicate(timeout=30)
    assert swapper.returncode == 0, err
    assert os.listdir(theirs) == [], "our files landed in their directory"
    assert _contents(other) == other_files, "another checkpoint of ours was replaced"
    assert_same(load_fresh(other), other_snapshot, "the other checkpoint")
    if guard == "as shipped":
        assert all("without the sticky bit" in o for o in outcomes), outcomes
        assert int(out) == 0  # nothing was staged to swap
        return
    assert int(out) >= 1, "the other user never caught a save: the test proved nothing"
    for outcome in outcomes:  # caught as the staged directory was made, or later
        assert outcome == "saved" or "was replaced as it was made" in outcome \
            or "was replaced while the save wrote into it" in outcome, outcome
