"""The file gate's writers: whole-or-old writes beside the target, from a held directory."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from schedules.files.walk import FileRefused, Path, held_directory, kind_of, refuse_planted

__all__ = ["fsync_directory", "write_atomic", "write_in"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def write_atomic(path: Path, content: str | bytes, *, encoding: str = "utf-8",
                 mode: int | None = None) -> None:
    """Write `content` to `path` so that `path` holds its old content or the new, whole, even
    if the process is killed or the machine loses power part-way.

    The bytes go to a temporary file beside `path` (same directory, so the same filesystem),
    created with the final mode (an existing file's, else 0o666 less the umask: no other user
    can open it when the final file would refuse them), flushed and fsynced, and renamed onto
    `path` from the same directory descriptor; the directory is then fsynced. Text is written
    as `encoding`, no newline translation. Links are followed by the gate's rules (one of
    yours, in your own directory, is; one another user planted is refused). A character
    device or a FIFO of yours or root's (`/dev/null`, a pipe being read) is written directly,
    as nothing can be renamed onto it; a FIFO nobody reads is refused, never waited on. A
    process killed part-way may leave a hidden `.<name>.<hex>.tmp` beside `path`. `mode`
    (e.g. 0o600 for a private file) is the regular file's mode from its first byte instead.
    """
    data = content.encode(encoding) if isinstance(content, str) else content
    shown = os.fspath(path)
    directory, name = held_directory(path)
    try:
        write_in(directory, name, data, shown, mode=mode)
    finally:
        os.close(directory)


def write_in(directory: int, name: str, data: bytes, shown: str, *,
             mode: int | None = None) -> None:
    """`write_atomic` of `data` to `name` in the held `directory` (`shown` names it in
    messages; `mode` as there)."""
    try:
        old: os.stat_result | None = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        old = None
    follow = old is not None and stat.S_ISLNK(old.st_mode)  # a descriptor of ours (_Walk.last)
    if follow:
        old = os.stat(name, dir_fd=directory)
    if name == "." or (old is not None and not stat.S_ISREG(old.st_mode)):
        kind = "a directory" if name == "." or old is None else kind_of(old.st_mode)
        if old is None or not (stat.S_ISCHR(old.st_mode) or stat.S_ISFIFO(old.st_mode)):
            raise FileRefused(f"{shown!r} is {kind}: write to a regular file's path")
        if not follow:
            refuse_planted(old, os.fstat(directory), shown)
        _write_special(directory, name, old, data, shown, follow=follow)
        return
    if follow:
        raise FileRefused(f"{shown!r} is a descriptor of this process on a regular file: "
                          f"write to that file's path")
    if old is not None:
        refuse_planted(old, os.fstat(directory), shown)
    final = mode if mode is not None else stat.S_IMODE(old.st_mode) if old is not None else None
    temp = f".{name}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    fd = os.open(temp, flags, 0o666 if final is None else final, dir_fd=directory)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            if final is not None:
                os.fchmod(f.fileno(), final)
        os.replace(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=directory)
        raise
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
        os.fsync(directory)


def _write_special(directory: int, name: str, old: os.stat_result, data: bytes,
                   shown: str, *, follow: bool = False) -> None:
    nofollow = 0 if follow else os.O_NOFOLLOW
    try:
        fd = os.open(name, os.O_WRONLY | nofollow | os.O_NONBLOCK | _CLOEXEC,
                     dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise FileRefused(f"{shown!r} is a FIFO nobody reads: it is not waited on") from None
        raise
    with open(fd, "wb") as f:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (old.st_dev, old.st_ino):
            raise FileRefused(f"{shown!r} was replaced while it was opened: write again")
        os.set_blocking(fd, True)  # a reader is there: let it take the bytes at its pace
        f.write(data)


def fsync_directory(path: Path | int) -> None:
    """Make the entries of directory `path` (or the held descriptor) durable: files created,
    renamed or removed in it. A no-op where directories cannot be opened for it (Windows)."""
    if isinstance(path, int):
        with contextlib.suppress(OSError):
            os.fsync(path)
        return
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)
