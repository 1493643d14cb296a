"""Checkpoint directories swapped in whole: written beside the target, marked complete, renamed.

A save of checkpoint directory `ckpt` never writes into `ckpt`. It holds the lock file
`ckpt.lock` (one save at a time: a second is refused, see `save_lock`), and every rank writes
into the staged sibling `ckpt.tmp-<token>`, created private (0700). Once every rank has agreed
that its writes succeeded, one rank gives the files and the directory their final modes (those
of the checkpoint replaced, see `modes_for`), marks it complete (a `.complete` file holding the
token, fsynced with the directory) and swaps it in with two renames:

    ckpt            -> ckpt.old-<token>      (skipped when there is no `ckpt` yet)
    ckpt.tmp-<token> -> ckpt                 (then the parent is fsynced)

and removes `ckpt.old-<token>` and any other `ckpt.tmp-*` / `ckpt.old-*` of this user left by
earlier saves that died. POSIX cannot rename a directory onto a non-empty one, so `ckpt` is
briefly missing between the renames. The recovery rule covers that window, and no clock enters
it: a token is `<generation>-<random>`, the generation one more than any this user's `ckpt` or
its siblings carry. A load of `ckpt` reads `ckpt` when it exists; otherwise, among this user's
staged siblings that carry `.complete`, the one whose token matches a `ckpt.old-<token>` (its
save had begun the swap: the old checkpoint was already renamed away), the greatest generation
if several; if none matches (there was no `ckpt` before), the greatest generation. A staged
directory without `.complete`, or not owned by this user (planted in a shared directory), is
never read and never counts. So `ckpt` resolves to the old checkpoint or the new one, each
complete; renames must be atomic on the filesystem (true of local POSIX filesystems).

This module holds the names and rules; `pipeline.state.save_dirs` makes, writes and renames a
save's directories relative to the descriptors it holds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from pipeline.errors import PipeConfigError
from schedules import files

__all__ = ["MARKER", "Modes", "modes_for", "new_token", "normal", "own_siblings", "read_marker",
           "resolve", "save_lock", "staged_path", "target_problem"]

MARKER = ".complete"
_LOCK = ".lock"
_TOKEN = r"([0-9a-f]{16})-([0-9a-f]{8})"
_PATTERN = r"\.(tmp|old)-" + _TOKEN
# What DCP's FileSystemWriter writes, and our marker: a directory holding only regular files
# of these names (or nothing) is a checkpoint that a save may replace.
_CHECKPOINT_FILE = re.compile(r"(\.metadata|\.metadata\.tmp|__\d+\.metadata|.*\.distcp|"
                              + re.escape(MARKER) + ")")
_NO_WRITE_FOR_OTHERS = ~0o022

Path = str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class Modes:
    """What a new checkpoint's directory and files get: permission bits, and the group when
    the old checkpoint had another one (None: the process's)."""

    directory: int
    files: int
    group: int | None


def new_token(path: Path) -> str:
    """The next generation of checkpoint `path` (one more than its own and its siblings'), then
    randomness. Call while holding `save_lock(path)`."""
    target = normal(path)
    seen = [int(m.group(2), 16) for _, m in own_siblings(target)]
    marker = read_marker(target)
    if marker is not None:
        seen.append(int(marker[:16], 16))
    generation = max(seen, default=0) + 1
    if generation >= 16**16:
        raise PipeConfigError(f"the generation of {target!r} would overflow (its "
                              f"siblings or marker hold {max(seen):#x}): remove its "
                              f".tmp-/.old- siblings")
    return f"{generation:016x}-{secrets.token_hex(4)}"


def staged_path(path: Path, token: str, kind: str = "tmp") -> str:
    """The sibling `<path>.tmp-<token>` (or `.old-<token>`) of checkpoint directory `path`."""
    return f"{normal(path)}.{kind}-{token}"


def read_marker(directory: Path, dir_fd: int | None = None) -> str | None:
    """The token in `directory`'s `.complete` (relative to `dir_fd` if given), if it is a
    regular file holding one; else None. Through the file gate: never follows a link another
    user planted, never blocks."""
    try:
        fd = (files.open_in(dir_fd, MARKER, shown=MARKER) if dir_fd is not None
              else files.open_file(os.path.join(directory, MARKER)))
    except (OSError, files.FileRefused):
        return None
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return text if re.fullmatch(_TOKEN, text) else None


def target_problem(path: Path) -> str | None:
    """Why a save may not replace `path` (it holds something other than a checkpoint), or
    None: absent, or a directory holding nothing but a checkpoint's regular files."""
    target = normal(path)
    if not os.path.lexists(target):
        return None
    if not os.path.isdir(target):
        return (f"{target!r} exists and is not a directory: save to a new path or a "
                f"checkpoint directory")
    with os.scandir(target) as entries:  # a directory or link named like a shard is not one
        others = sorted(e.name for e in entries if not _CHECKPOINT_FILE.fullmatch(e.name)
                        or not e.is_file(follow_symlinks=False))
    if others:
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        return (f"{target!r} holds files that are not a checkpoint's ({others[:5]}{more}), and a "
                f"save replaces the whole directory: save to a new or empty directory, or "
                f"remove them")
    return None


@contextlib.contextmanager
def save_lock(path: Path, directory: int | None = None) -> Iterator[None]:
    """Hold `<path>.lock` for one save of `path` (in the held `directory`, its parent, if
    given): a second save at the same time (another process or thread) is refused with
    PipeConfigError, not queued (see docs/checkpoints.md)."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # no flock (Windows): one save at a time is the caller's to ensure
        yield
        return
    lock = normal(path) + _LOCK
    own = directory is None
    if directory is None:
        try:  # its directory made as DCP would: `runs/step-1000`
            directory, name = files.held_directory(lock, create=True)
        except files.FileRefused as exc:
            raise PipeConfigError(str(exc)) from None
    else:
        name = os.path.basename(lock)
    try:
        fd = _locked(directory, name, lock, normal(path))
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=directory)  # before unlocking: a waiter locks a new file
            os.close(fd)
    finally:
        if own:
            os.close(directory)


def _locked(directory: int, name: str, lock: str, target: str) -> int:
    """The lock file `name` in the held `directory`, created if absent, flock-ed."""
    import fcntl

    while True:
        try:
            fd = files.open_in(directory, name, shown=lock, create=0o600)
        except (OSError, files.FileRefused) as exc:
            raise PipeConfigError(
                f"a save of {target!r} takes {lock!r} as its lock file, and {exc}; it is left "
                f"alone: move it, or save under another name") from None
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            os.close(fd)
            raise PipeConfigError(
                f"a save of {target!r} takes {lock!r} as its lock file, and that file "
                f"belongs to another user (uid {info.st_uid}); it is left alone: save under "
                f"another name, or in a directory only you can write")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise PipeConfigError(f"another save of {target!r} is running (it holds "
                                  f"{lock!r}); two at once would replace each other's "
                                  f"checkpoint: wait for it, or save to another path") from exc
        try:  # a save that just finished removed the file we locked: lock the new one
            current = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            os.close(fd)
            continue
        if (current.st_dev, current.st_ino) == (info.st_dev, info.st_ino):
            return fd
        os.close(fd)


def modes_for(path: Path) -> Modes:
    """The modes of the checkpoint at `path` (its directory, and the narrowest of its files),
    or from the umask if there is none; never write for group or others on the directory
    (a load refuses such a directory)."""
    target = normal(path)
    try:
        old = os.lstat(target)
    except FileNotFoundError:
        umask = _umask()
        return Modes((0o777 & ~umask) & _NO_WRITE_FOR_OTHERS, 0o666 & ~umask, None)
    files = 0o7777
    with os.scandir(target) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                files &= stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
    if files == 0o7777:  # no files: what the directory grants, without execute
        files = stat.S_IMODE(old.st_mode) & 0o666
    group = old.st_gid if old.st_gid != os.getegid() else None
    return Modes(stat.S_IMODE(old.st_mode) & _NO_WRITE_FOR_OTHERS & 0o777, files & 0o777,
                 group)


def resolve(path: Path) -> str:
    """The directory a load of `path` reads: `path` if it exists, else this user's complete
    staged sibling that the module's rule picks (a save died between its renames), else
    `path`."""
    target = normal(path)
    if os.path.lexists(target):
        return target
    parent = os.path.dirname(target)
    siblings = own_siblings(target)
    old = {m.group(2, 3) for _, m in siblings if m.group(1) == "old"}
    complete = [(int(m.group(2), 16), name, m.group(2, 3) in old) for name, m in siblings
                if m.group(1) == "tmp" and _own_marker(os.path.join(parent, name))]
    mid_swap = [c for c in complete if c[2]]
    chosen = max(mid_swap or complete, default=None)
    return os.path.join(parent, chosen[1]) if chosen is not None else target


def _own_marker(staged: str) -> bool:
    try:
        info = os.lstat(os.path.join(staged, MARKER))
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def own_siblings(target: str, dir_fd: int | None = None) -> list[tuple[str, re.Match[str]]]:
    """The `.tmp-` / `.old-` siblings of `target` that are directories of this user (another
    user's, planted in a shared directory, are not ours to read, count or remove); looked up
    in the held `dir_fd` (its parent) if given."""
    parent = os.path.dirname(target)
    pattern = re.compile(re.escape(os.path.basename(target)) + _PATTERN)
    try:
        names = os.listdir(parent if dir_fd is None else dir_fd)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        try:
            info = (os.lstat(os.path.join(parent, name)) if dir_fd is None
                    else os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            found.append((name, match))
    return found


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (no race with
    threads creating files); else set and restored."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal(path: Path) -> str:
    """`path` absolute, without trailing separators (`ckpt/` has the sibling `ckpt.tmp-*`) and
    with links resolved by the file gate's rules (one of yours keeps pointing at the new
    checkpoint; one another user planted is refused, PipeConfigError)."""
    try:
        return files.resolve(path)
    except files.FileRefused as exc:
        raise PipeConfigError(str(exc)) from None
