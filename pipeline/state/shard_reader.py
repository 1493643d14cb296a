"""Reading a sharded checkpoint that is not trusted: no pickle in it runs code, bad files are named.

DCP's own reader unpickles `.metadata` with `pickle.load` and the planner reads saved objects
with `torch.load(weights_only=False)`: a crafted checkpoint could run code on load. Here the
metadata is unpickled with only DCP's metadata classes (and torch's sizes, dtypes and layouts)
allowed, saved objects are read with `weights_only=True`, and every shard file the metadata
names is checked to exist inside the directory and to be long enough, before DCP reads any.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["Planner", "Reader", "read_metadata", "shard_problems"]

_METADATA = ".metadata"
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and dtypes, below
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never "
                                     f"holds (refused: unpickling it could run code)")


def read_metadata(path: str) -> Metadata:
    """The `.metadata` of checkpoint directory `path`, unpickled with only DCP's classes.
    Raises FileNotFoundError/NotADirectoryError if absent, ValueError if it is not DCP's."""
    with open(os.path.join(path, _METADATA), "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except Exception as exc:  # any unpickling failure: a damaged or foreign file
            raise ValueError(f"its {_METADATA} cannot be read ({type(exc).__name__}: {exc})"
                             ) from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"its {_METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def shard_problems(path: str, metadata: Metadata) -> list[str]:
    """Shard files the metadata names that are outside `path`, missing, or shorter than the
    entries it places in them (a save cut short, or a copy that was)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if (not isinstance(name, str) or not name or os.path.basename(name) != name
                or name in (".", "..")):
            return [f"its {_METADATA} names a shard file {name!r} outside the directory"]
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        try:
            size = os.stat(os.path.join(path, name)).st_size
        except OSError:
            problems.append(f"shard file {name!r} is missing")
            continue
        if size < end:
            problems.append(f"shard file {name!r} is cut short ({size} bytes; its entries "
                            f"need {end})")
    return problems


class Reader(FileSystemReader):
    """DCP's file-system reader, unpickling `.metadata` with only DCP's classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's default load planner, reading saved objects (not tensors) with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Refuse anything beyond plain data first; then torch's own load (weights_only=False)
        # sees only what weights_only accepted.
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)
