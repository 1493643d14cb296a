"""DCP's FileSystemWriter writing into a held directory descriptor, never by path.

torch's writer creates each shard and `.metadata` by joining names onto the checkpoint's path,
so whatever that path names when a file is opened receives it: a staged directory renamed away
and its name linked elsewhere sent a save's files there. This writer keeps torch's planning,
serialisation and fsyncs and swaps only its filesystem: every name is a plain file name,
created (`O_EXCL`, no link followed, mode 0600) and renamed relative to the descriptor the save
holds, so the files land in the directory the save opened whatever its name comes to mean.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from pathlib import PurePosixPath
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter

__all__ = ["HeldFileSystem", "HeldWriter"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC


class HeldFileSystem(FileSystemBase):
    """The files of one held directory: DCP's paths are names in it, nothing else."""

    def __init__(self, directory: int, shown: str) -> None:
        self.directory = directory
        self.shown = shown  # the staged path, for messages and DCP's checkpoint id

    def _name(self, path: str | os.PathLike[str]) -> str:
        name = os.fspath(path)
        if not name or "/" in name or name in (".", ".."):  # DCP names files, never paths
            raise ValueError(f"DCP asked for {name!r} in {self.shown!r}: only plain file "
                             f"names are written into a held checkpoint directory")
        return name

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str
                      ) -> Generator[Any, None, None]:
        if "w" not in mode:
            raise ValueError(f"a held checkpoint directory is written, not read (mode {mode!r})")
        fd = os.open(self._name(path), _CREATE, 0o600, dir_fd=self.directory)
        with os.fdopen(fd, mode) as stream:
            yield stream

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return self._name(suffix)

    def init_path(self, path: str | os.PathLike[str]) -> PurePosixPath:
        return PurePosixPath(self.shown)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        os.rename(self._name(path), self._name(new_path), src_dir_fd=self.directory,
                  dst_dir_fd=self.directory)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """The held directory exists: nothing to make."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen for a path by DCP: only given, holding its descriptor

    def exists(self, path: str | os.PathLike[str]) -> bool:
        try:
            os.stat(self._name(path), dir_fd=self.directory, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        os.unlink(self._name(path), dir_fd=self.directory)


class HeldWriter(FileSystemWriter):
    """torch's FileSystemWriter (one file per rank, fsynced) into the held `directory`, which
    `shown` names; the caller keeps the descriptor open until the save returns."""

    def __init__(self, directory: int, shown: str) -> None:
        super().__init__(shown, sync_files=True)
        held = HeldFileSystem(directory, shown)
        self.fs = cast(Any, held)  # torch types it as its own FileSystem: any FileSystemBase does
        self.path = held.init_path(shown)
        self.shown = shown

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.shown:
            raise ValueError(f"this writer writes into {self.shown!r} only")
        super().reset(None)
