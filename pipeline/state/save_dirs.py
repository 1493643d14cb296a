"""A save's directories held open: every file of a save made relative to a descriptor it holds.

The first rank opens the checkpoint's parent through the file gate and holds it; the lock
file, the staged directory, the final renames and the clean-up are names in that descriptor.
It makes the staged directory (0700) there and holds it too: the ranks' shards and
`.metadata` (`pipeline.state.held_writer`), the marker and the final modes go into that
descriptor. A name swapped after the gate looked (the staged directory renamed away and its
name linked elsewhere) changes where nothing is written: the files stay in the directory the
save made, and a staged name that is no longer it is never renamed into place (the save fails
and removes what it wrote).

Renames are still by name: `rename` has no form that says "only if it is still this
directory". So a save refuses, up front, a parent in which others may rename its entries: one
that group or others may write without the sticky bit, or such a directory above it (see
`refuse_renamable`). There only this user, root and the directory's owner can rename what a
save made, and the checks before each rename catch what a program of theirs did meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from pipeline.errors import PipeConfigError
from pipeline.state import staging
from schedules import files

__all__ = ["Parent", "Replaced", "Staged", "clean", "discard", "held_parent", "join",
           "mark_complete", "prepare", "refuse_renamable", "seal", "swap_in"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | _CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


class Replaced(PipeConfigError):
    """A directory of the save was renamed away and its name given to something else."""


@dataclass(frozen=True, slots=True)
class Parent:
    """The checkpoint's parent directory, held: its descriptor, its path (for messages), the
    checkpoint's name in it, and the checkpoint's path."""

    fd: int
    where: str
    name: str
    target: str


@dataclass(frozen=True, slots=True)
class Staged:
    """The staged directory of a save, held: its descriptor, its path (for messages and DCP)
    and, on the rank that made it, its parent (else None)."""

    fd: int
    shown: str
    parent: Parent | None = None

    @property
    def name(self) -> str:
        return os.path.basename(self.shown)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


@contextlib.contextmanager
def held_parent(path: staging.Path) -> Iterator[Parent]:
    """The parent of checkpoint `path`, walked by the gate's rules (missing directories made,
    as DCP would), held while the save runs; PipeConfigError if the gate refuses it or if
    others may rename entries in it (`refuse_renamable`)."""
    target = staging.normal(path)
    try:
        fd, name = files.held_directory(target, create=True)
    except files.FileRefused as exc:
        raise PipeConfigError(str(exc)) from None
    try:
        if name in (".", ".."):
            raise PipeConfigError(f"{target!r} names no directory entry a save could replace: "
                                  f"give the checkpoint's own path")
        refuse_renamable(fd, os.path.dirname(target))
        yield Parent(fd, os.path.dirname(target), name, target)
    finally:
        os.close(fd)


def refuse_renamable(directory: int, where: str) -> None:
    """PipeConfigError if the held `directory` (at `where`), or any directory above it, may be
    written by group or others without the sticky bit: any of them may then rename the save's
    entries (or a directory above them) and put theirs, or another checkpoint of ours, in
    their place. The directories above are those the descriptor leads to by `..`, whatever
    their names."""
    current = os.open(".", _DIRECTORY, dir_fd=directory)
    shown = where
    try:
        while True:
            info = os.fstat(current)
            if files.shared(info) and not info.st_mode & stat.S_ISVTX:
                mode = stat.S_IMODE(info.st_mode)
                raise PipeConfigError(
                    f"{shown!r} is writable by other users without the sticky bit (mode "
                    f"{mode:#o}): any of them may rename a save's directories in it (or the "
                    f"directory holding them), to have its files written into theirs or to "
                    f"have it replace another checkpoint of yours; chmod +t {shown!r} (then "
                    f"only an entry's owner may rename it), or save under a directory only "
                    f"you can write")
            above = os.open("..", _DIRECTORY, dir_fd=current)
            os.close(current)
            current = above
            up = os.fstat(current)
            if (up.st_dev, up.st_ino) == (info.st_dev, info.st_ino):  # the root
                return
            shown = os.path.dirname(shown)
    finally:
        os.close(current)


def prepare(parent: Parent, token: str) -> Staged:
    """Make this save's staged directory `<name>.tmp-<token>` in the held parent, private
    (0700) until `seal`, and hold it."""
    name = f"{parent.name}.tmp-{token}"
    shown = os.path.join(parent.where, name)
    os.mkdir(name, 0o700, dir_fd=parent.fd)
    try:
        fd = os.open(name, _DIRECTORY, dir_fd=parent.fd)
    except OSError as exc:  # a link or a file in its place already
        raise Replaced(f"the staged directory {shown!r} was replaced as it was made "
                       f"({exc.strerror}): save again, in a directory only you can write"
                       ) from None
    staged = Staged(fd, shown, parent)
    if os.fstat(fd).st_uid != os.geteuid() or os.listdir(fd):
        staged.close()
        raise Replaced(f"the staged directory {shown!r} was replaced as it was made (it is "
                       f"not the empty directory of yours just made): save again, in a "
                       f"directory only you can write")
    os.fchmod(fd, 0o700)  # the umask may have narrowed it further
    return staged


def join(shown: str, inode: int) -> Staged:
    """The staged directory another rank made (inode `inode`), opened by the gate's rules
    and held; Replaced if what `shown` names is not that directory."""
    try:
        fd = files.open_directory(shown, private=True)
    except files.FileRefused as exc:
        raise PipeConfigError(str(exc)) from None
    info = os.fstat(fd)
    if info.st_ino != inode or info.st_uid != os.geteuid():
        os.close(fd)
        raise Replaced(f"the staged directory {shown!r} is not the one the first rank made "
                       f"(inode {info.st_ino}, not {inode}): it was replaced; save again")
    return Staged(fd, shown)


def mark_complete(staged: Staged, token: str) -> None:
    """Record that every rank wrote its part of `staged` (call after they agreed)."""
    with contextlib.suppress(OSError):  # the ranks' files are in it before the marker says so
        os.fsync(staged.fd)
    files.write_in(staged.fd, staging.MARKER, (token + "\n").encode(),
                   os.path.join(staged.shown, staging.MARKER))


def seal(staged: Staged, modes: staging.Modes) -> None:
    """Give the staged directory's regular files, then the directory, their final `modes`
    (files first, so none is ever wider than it ends)."""
    for name in os.listdir(staged.fd):
        try:
            fd = os.open(name, _FILE, dir_fd=staged.fd)
        except OSError:  # a link, a FIFO nobody reads: no file of a save
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                _set_mode(fd, modes.files, modes.group)
        finally:
            os.close(fd)
    _set_mode(staged.fd, modes.directory, modes.group)


def _set_mode(fd: int, mode: int, group: int | None) -> None:
    if group is not None:
        try:
            os.fchown(fd, -1, group)
        except OSError:  # not a member of the old group: nobody of that group gets in either
            mode &= ~0o070
    os.fchmod(fd, mode)


def swap_in(staged: Staged, token: str) -> None:
    """Replace the checkpoint by the complete `staged` one (two renames in the held parent),
    then remove the old one and what earlier, interrupted saves left. Replaced, with nothing
    renamed (and what the save wrote removed), if the staged name no longer holds `staged`."""
    parent = staged.parent
    assert parent is not None, "only the rank that made the staged directory swaps it in"
    _still_there(staged, parent, old=None)
    old = f"{parent.name}.old-{token}"
    moved = _exists(parent.name, parent.fd)
    if moved:
        os.rename(parent.name, old, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
        files.fsync_directory(parent.fd)
    _still_there(staged, parent, old=old if moved else None)
    os.rename(staged.name, parent.name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
    files.fsync_directory(parent.fd)
    clean(parent)


def _exists(name: str, directory: int) -> bool:
    try:
        os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _still_there(staged: Staged, parent: Parent, old: str | None) -> None:
    """Replaced unless the staged name in the parent is still the held directory; the old
    checkpoint (renamed to `old`) is put back first, and what the save wrote is removed."""
    try:
        now = os.stat(staged.name, dir_fd=parent.fd, follow_symlinks=False)
        kind = "a link" if stat.S_ISLNK(now.st_mode) else "another entry"
    except FileNotFoundError:
        now, kind = None, "nothing"
    held = os.fstat(staged.fd)
    if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
        return
    if old is not None:
        os.rename(old, parent.name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
        files.fsync_directory(parent.fd)
    discard(staged)
    raise Replaced(f"the staged directory {staged.shown!r} was replaced while the save wrote "
                   f"into it (its name holds {kind} now): nothing was written there, "
                   f"{parent.target!r} is as it was, and what the save wrote is removed; keep "
                   f"checkpoints in a directory only you can write")


def discard(staged: Staged) -> None:
    """Remove what the save wrote into the held staged directory, and the directory if its
    name in the parent still holds it (the rank that made it only)."""
    _empty(staged.fd)
    parent = staged.parent
    if parent is None:
        return
    with contextlib.suppress(OSError):
        now = os.stat(staged.name, dir_fd=parent.fd, follow_symlinks=False)
        held = os.fstat(staged.fd)
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            os.rmdir(staged.name, dir_fd=parent.fd)


def clean(parent: Parent) -> None:
    """Remove this user's `<name>.tmp-<token>` and `<name>.old-<token>` siblings in the held
    parent (only names of exactly that form; call only once the checkpoint is complete).
    Another user's are left alone: they never count (see `staging.resolve`)."""
    for name, _ in staging.own_siblings(parent.target, dir_fd=parent.fd):
        with contextlib.suppress(OSError):
            fd = os.open(name, _DIRECTORY, dir_fd=parent.fd)
            try:
                _empty(fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=parent.fd)


def _empty(directory: int) -> None:
    """Remove every entry of the held `directory`, directories within it too, never through
    a link."""
    for name in os.listdir(directory):
        with contextlib.suppress(OSError):
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                os.unlink(name, dir_fd=directory)
                continue
            fd = os.open(name, _DIRECTORY, dir_fd=directory)
            try:
                _empty(fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=directory)
