"""A checkpoint directory opened once: `.metadata` and every shard file held open before reading.

A load resolves the directory (`staging.resolve`), opens it, and opens `.metadata` and each
shard file the metadata names relative to that directory descriptor, never following a link
and without blocking (a FIFO named `.metadata` is refused, not waited on); only regular files
count. DCP then reads from those descriptors (`shard_reader.Reader`). A save that swaps a new
checkpoint in meanwhile renames the directory away and its clean-up unlinks the files: files
already open stay readable, so the load sees the checkpoint it opened, whole. A file that
vanished before it was opened means the directory was replaced: the load resolves again and
retries (`_ATTEMPTS` times; a save that keeps winning that race is reported, never mixed in).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import Metadata

from pipeline.errors import PipeConfigError
from pipeline.state import shard_reader, staging

__all__ = ["Opened", "open_checkpoint"]

_ATTEMPTS = 8
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFLNK: "a symbolic link"}


class _Replaced(Exception):
    """A file vanished because a save replaced the directory while it was being opened."""


@dataclass
class Opened:
    """An opened checkpoint: the directory read (`path`), its checked metadata, the shard files
    by name (descriptors), what identifies this very checkpoint (its token, or its metadata
    file's identity), and `damage`: shard files missing, of another kind, or cut short."""

    path: str
    metadata: Metadata
    files: dict[str, int]
    identity: str
    damage: list[str] = field(default_factory=list)

    def close(self) -> None:
        for fd in self.files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.files = {}


def open_checkpoint(path: str | os.PathLike[str]) -> Opened:
    """Open the checkpoint a load of `path` reads. Raises FileNotFoundError or
    NotADirectoryError when there is none, ValueError when it is damaged (the message names
    the file and field), PipeConfigError when it may not be read (other users may write it)."""
    for _ in range(_ATTEMPTS):
        source = staging.resolve(path)
        try:
            return _open(source, path)
        except _Replaced:
            continue
    raise PipeConfigError(f"{os.fspath(path)!r} was replaced {_ATTEMPTS} times while "
                          f"its files were being opened (saves in a tight loop?): load again")


def _open(source: str, path: str | os.PathLike[str]) -> Opened:
    try:
        directory = os.open(source, _FLAGS | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        if staging.resolve(path) != source:
            raise _Replaced from None
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link put there after it was resolved
            raise _Replaced from None
        raise
    try:
        _check_directory(source, os.fstat(directory))
        data = _read_whole(_open_file(directory, shard_reader.METADATA, source, path))
        metadata = shard_reader.unpickle_metadata(data)
        identity = staging.read_marker(source, dir_fd=directory) or _identity(
            directory, shard_reader.METADATA)
        opened = Opened(source, metadata, {}, identity)
        try:
            for name, end in sorted(shard_reader.shard_ends(metadata).items()):
                _open_shard(opened, directory, name, end, path)
        except BaseException:
            opened.close()
            raise
        return opened
    finally:
        os.close(directory)


def _check_directory(source: str, info: os.stat_result) -> None:
    """Refuse a directory others may write to (they could swap its files while it loads), and
    another user's in a directory where anyone may create one (it may be planted)."""
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise PipeConfigError(
            f"the checkpoint directory {source!r} is writable by other users (mode "
            f"{mode:#o}): they could replace its files as it loads; if you trust them, "
            f"chmod go-w {source!r} (a save never makes one so)")
    parent = os.path.dirname(source)
    if info.st_uid != os.geteuid() and os.stat(parent).st_mode & 0o002:
        raise PipeConfigError(
            f"the checkpoint directory {source!r} belongs to another user (uid {info.st_uid}) "
            f"and lies in {parent!r}, where anyone may create it: it may be planted; load a "
            f"copy you made, or one from a directory only its owner can write")


def _open_file(directory: int, name: str, source: str, path: str | os.PathLike[str]) -> int:
    """`name` in the directory, opened read-only without following a link or blocking, if it
    is a regular file. FileNotFoundError if absent (_Replaced if the directory was replaced),
    ValueError naming its kind otherwise."""
    try:
        fd = os.open(name, _FLAGS, dir_fd=directory)
    except FileNotFoundError:
        if _was_replaced(source, directory, path):
            raise _Replaced from None
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW on a link (EMLINK: BSD)
            raise ValueError(f"its {name} is a symbolic link, not a regular file (refused: "
                             f"a checkpoint's files lie in its directory)") from exc
        if exc.errno == errno.ENXIO:  # a socket, or a FIFO on some systems
            raise ValueError(f"its {name} is a socket or FIFO, not a regular file") from exc
        raise ValueError(f"its {name} cannot be opened ({exc.strerror})") from exc
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        raise ValueError(f"its {name} is {_KINDS.get(kind, 'no regular file')}, not a "
                         f"regular file")
    return fd


def _open_shard(opened: Opened, directory: int, name: str, end: int,
                path: str | os.PathLike[str]) -> None:
    try:
        fd = _open_file(directory, name, opened.path, path)
    except FileNotFoundError:
        opened.damage.append(f"shard file {name!r} is missing")
        return
    except ValueError as exc:
        opened.damage.append(str(exc).replace(f"its {name}", f"shard file {name!r}", 1))
        return
    opened.files[name] = fd
    size = os.fstat(fd).st_size
    if size < end:
        opened.damage.append(f"shard file {name!r} is cut short ({size} bytes; its entries "
                             f"need {end})")


def _was_replaced(source: str, directory: int, path: str | os.PathLike[str]) -> bool:
    """Whether the directory opened is no longer what a load of `path` reads."""
    if staging.resolve(path) != source:
        return True
    try:
        now = os.stat(source, follow_symlinks=False)
    except OSError:
        return True
    was = os.fstat(directory)
    return (now.st_dev, now.st_ino) != (was.st_dev, was.st_ino)


def _read_whole(fd: int) -> bytes:
    try:
        chunks: list[bytes] = []
        offset = 0
        while True:
            chunk = os.pread(fd, 1 << 20, offset)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            offset += len(chunk)
    finally:
        os.close(fd)


def _identity(directory: int, name: str) -> str:
    info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    return f"{info.st_dev}:{info.st_ino}:{info.st_mtime_ns}"
