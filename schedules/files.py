"""Files written whole or not at all: a temporary sibling, fsync, then one atomic rename."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

__all__ = ["fsync_directory", "write_atomic"]

Path = str | os.PathLike[str]


def write_atomic(path: Path, content: str | bytes, *, encoding: str = "utf-8") -> None:
    """Write `content` to `path` so that `path` holds its old content or the new, whole, even
    if the process is killed or the machine loses power part-way.

    The bytes go to a temporary file beside `path` (same directory, so the same filesystem),
    are flushed and fsynced, and `os.replace` renames it onto `path` (atomic on POSIX and
    Windows within one filesystem); the directory is then fsynced so the rename itself lasts.
    Text is written as `encoding` with no newline translation. A symbolic link is followed (its
    target is replaced); a path that exists but is no regular file (a device, a pipe such as
    /dev/stdout) is written directly, as nothing can be renamed onto it. A process killed
    part-way may leave a hidden `.<name>.<hex>.tmp` beside `path`; `path` is never touched.
    """
    data = content.encode(encoding) if isinstance(content, str) else content
    target = os.path.realpath(path)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.stat(target).st_mode):
            with open(target, "wb") as f:
                f.write(data)
            return
    directory, name = os.path.split(target)
    temp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
    # An existing file keeps its mode; a new one gets 0o666 less the umask, as open() would
    # create it. The temporary file is created with that mode (the umask can only narrow it),
    # so no other user can open it at any moment when the final file would refuse them; the
    # exact mode is set once the bytes are in.
    final = None
    with contextlib.suppress(FileNotFoundError):
        final = stat.S_IMODE(os.stat(target).st_mode)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = os.open(temp, flags, 0o666 if final is None else final)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            if final is not None and hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), final)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_directory(directory)


def fsync_directory(path: Path) -> None:
    """Make the entries of directory `path` (files created, renamed or removed in it) durable.
    A no-op where directories cannot be opened for it (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)
