"""A checkpoint directory opened once, through the file gate, and its files read from it.

A load resolves the directory (`staging.resolve`), opens it through the gate
(`schedules.files`: no link another user planted, no directory of another user where anyone
may create one, none that others may write), holds that descriptor, and opens `.metadata` and
each shard file relative to it, as regular files only, never blocking, and checks each shard's
kind and length. As many shard files as the open-file limit comfortably allows (`_budget`) stay
open; the others are closed again and reopened from the same held directory when DCP reads
them (`shard_reader.Reader`), one at a time: a checkpoint of any number of files loads under
any open-file limit.

Why that is one checkpoint: a save never writes into a checkpoint directory; it swaps a new
one in by renaming, then removes the old one's files. Every file opened from the held
descriptor is therefore of the checkpoint whose metadata was read, or gone. A load that holds
every file open reads the checkpoint it opened whatever saves do meanwhile; a file that
vanished before it was opened means the directory was replaced, and the load starts again from
the new one (`ATTEMPTS` times; a save that keeps winning that race is reported, never mixed
in).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import Metadata

from pipeline.errors import PipeConfigError
from pipeline.state import shard_reader, staging
from schedules import files

__all__ = ["ATTEMPTS", "MAX_METADATA_BYTES", "Opened", "open_checkpoint"]

ATTEMPTS = 8
# DCP's metadata holds a few hundred bytes per tensor chunk: a gibibyte is millions of
# tensors. A larger `.metadata` (or a sparse one of 64 GiB) is refused before it is read.
MAX_METADATA_BYTES = 1 << 30


@dataclass
class Opened:
    """An opened checkpoint: the directory read (`path`) and its held descriptor, its checked
    metadata, what identifies this very checkpoint (its token, or its metadata file's
    identity), and `damage`: shard files missing, of another kind, or cut short."""

    path: str
    directory: int
    metadata: Metadata
    identity: str
    damage: list[str] = field(default_factory=list)
    held: dict[str, int] = field(default_factory=dict)  # shard files kept open, by name

    def close(self) -> None:
        for fd in self.held.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.held = {}
        if self.directory >= 0:
            with contextlib.suppress(OSError):
                os.close(self.directory)
            self.directory = -1


def open_checkpoint(path: str | os.PathLike[str]) -> Opened:
    """Open the checkpoint a load of `path` reads. Raises FileNotFoundError or
    NotADirectoryError when there is none, ValueError when it is damaged (the message names
    the file and field), PipeConfigError when it may not be read (the gate refused it)."""
    for _ in range(ATTEMPTS):
        source = staging.resolve(path)
        try:
            return _open(source, path)
        except shard_reader.Replaced:
            continue
        except files.FileRefused as exc:
            raise PipeConfigError(str(exc)) from None
    raise PipeConfigError(f"{os.fspath(path)!r} was replaced {ATTEMPTS} times while "
                          f"its files were being opened (saves in a tight loop?): load again")


def _open(source: str, path: str | os.PathLike[str]) -> Opened:
    try:
        directory = files.open_directory(source, private=True)
    except FileNotFoundError:
        # Gone between the look and the open: a save swapped it away, and another may stand
        # there again under the same name (its second rename done): read what is there now.
        if staging.resolve(path) != source or os.path.lexists(source):
            raise shard_reader.Replaced(source) from None
        raise
    opened = Opened(source, directory, Metadata({}), "")
    try:
        fd = _open_file(opened, shard_reader.METADATA, path)
        try:
            data = files.read_bytes(fd, limit=MAX_METADATA_BYTES, shown=shard_reader.METADATA)
        finally:
            os.close(fd)
        opened.metadata = shard_reader.unpickle_metadata(data)
        opened.identity = (staging.read_marker(source, dir_fd=directory)
                           or _identity(opened, shard_reader.METADATA, path))
        budget = _budget()
        for name, end in sorted(shard_reader.shard_ends(opened.metadata).items()):
            _check_shard(opened, name, end, path, keep=len(opened.held) < budget)
    except files.FileRefused as exc:  # `.metadata` of another kind, or too large
        opened.close()
        raise ValueError(f"its {exc}") from None
    except BaseException:
        opened.close()
        raise
    return opened


def _open_file(opened: Opened, name: str, path: str | os.PathLike[str]) -> int:
    """`name` in the held directory as a regular file (the gate's `open_in`);
    `shard_reader.Replaced` if it vanished because the directory was replaced."""
    try:
        with _gone_means_replaced(opened, path):
            return files.open_in(opened.directory, name, shown=name)
    except FileNotFoundError:  # gone, and not by a save: the caller says what is missing
        raise
    except OSError as exc:
        raise files.FileRefused(f"{name!r} cannot be opened ({exc.strerror})") from None


def _budget() -> int:
    """How many shard files a load keeps open: half of what the open-file limit leaves free
    (DCP, torch and the job's sockets need the rest), less a margin."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > 1 << 16:
        soft = 1 << 16
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume a busy process
        in_use = soft // 4
    return max(0, (soft - in_use) // 2 - 16)


def _check_shard(opened: Opened, name: str, end: int, path: str | os.PathLike[str], *,
                 keep: bool) -> None:
    try:
        fd = _open_file(opened, name, path)
    except FileNotFoundError:
        opened.damage.append(f"shard file {name!r} is missing")
        return
    except files.FileRefused as exc:
        opened.damage.append(f"shard file {exc}")
        return
    size = os.fstat(fd).st_size
    if keep:
        opened.held[name] = fd
    else:
        os.close(fd)
    if size < end:
        opened.damage.append(f"shard file {name!r} is cut short ({size} bytes; its entries "
                             f"need {end})")


@contextlib.contextmanager
def _gone_means_replaced(opened: Opened, path: str | os.PathLike[str]) -> Iterator[None]:
    """A file of the held directory vanished inside: `shard_reader.Replaced` if a save swapped
    the directory away (and removed it), else the FileNotFoundError as it is."""
    try:
        yield
    except FileNotFoundError:
        if _was_replaced(opened, path):
            raise shard_reader.Replaced(opened.path) from None
        raise


def _was_replaced(opened: Opened, path: str | os.PathLike[str]) -> bool:
    """Whether the directory opened is no longer what a load of `path` reads."""
    try:
        if staging.resolve(path) != opened.path:
            return True
        now = os.stat(opened.path, follow_symlinks=False)
    except (OSError, PipeConfigError):
        return True
    was = os.fstat(opened.directory)
    return (now.st_dev, now.st_ino) != (was.st_dev, was.st_ino)


def _identity(opened: Opened, name: str, path: str | os.PathLike[str]) -> str:
    """What tells this checkpoint from another: `name`'s device, inode and time (for one
    without a marker); `shard_reader.Replaced` if it vanished because a save swapped the
    directory away and removed it (its marker went first)."""
    with _gone_means_replaced(opened, path):
        info = os.stat(name, dir_fd=opened.directory, follow_symlinks=False)
    return f"{info.st_dev}:{info.st_ino}:{info.st_mtime_ns}"
