"""Reading a sharded checkpoint that is not trusted: no pickle runs code, bad fields are named.

DCP's own reader unpickles `.metadata` with `pickle.load` and the planner reads saved objects
with `torch.load(weights_only=False)`: a crafted checkpoint could run code on load. Here the
metadata is unpickled with only DCP's metadata classes (and torch's sizes, dtypes and layouts)
allowed, every field DCP and `sharded.load` use is checked for its type and range (a crafted
file then raises an error naming the field, never some exception from deep inside DCP), saved
objects are read with `weights_only=True`, and DCP reads the shard files from the directory
descriptor `pipeline.state.opened` holds, never by a path from the top.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import io
import os
import pickle
import reprlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from pipeline.state import coverage
from schedules import files

__all__ = ["MAX_CHUNKS", "MAX_KEY", "MAX_TENSOR_CHUNKS", "METADATA", "Planner", "Reader",
           "Replaced", "check_metadata", "shard_ends", "unpickle_metadata"]

METADATA = ".metadata"
MAX_KEY = 4096  # characters in a key: a module path, never a page of dots
# A save writes one chunk per tensor and rank holding part of it. Keys may share one entry
# object in a pickle (a reference each, a few bytes): its chunks count once per key, as each
# key's are looked up, so these bound the work a small file can ask for.
MAX_TENSOR_CHUNKS = 1 << 16
MAX_CHUNKS = 1 << 20
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and dtypes, below
    # StorageMeta's checkpoint_id is the path DCP saved to, a pathlib object
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}
# Python 3.11.0 to 3.11.4 (Debian 12 has 3.11.2) pickle an enum member as
# `builtins.getattr(cls, name)`: allowed for members of these classes, nothing else.
_ENUMS: tuple[type[enum.Enum], ...] = (dcp_metadata._MEM_FORMAT_ENCODING,)


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """`getattr(cls, name)` as those Pythons pickle an enum member; refused for anything else."""
    if cls in _ENUMS and isinstance(name, str) and name in cls.__members__:
        member: enum.Enum = cls.__members__[name]
        return member
    raise pickle.UnpicklingError(f"it calls getattr({cls!r}, {name!r}), which DCP metadata "
                                 f"never holds but for members of {[e.__name__ for e in _ENUMS]}"
                                 f" (refused: unpickling it could run code)")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name == "getattr":
            return _enum_member
        if name in _ALLOWED.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never "
                                     f"holds (refused: unpickling it could run code)")


def unpickle_metadata(data: bytes) -> Metadata:
    """`.metadata`'s bytes as DCP metadata, checked (`check_metadata`); ValueError naming the
    file and the field if they are not DCP's."""
    # Millions of small objects, none in a cycle: the cyclic collector would walk the growing
    # heap again and again meanwhile (half the time of a large file).
    collecting = gc.isenabled()
    gc.disable()
    try:
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as exc:  # any unpickling failure: a damaged or foreign file
            raise ValueError(f"its {METADATA} cannot be read ({type(exc).__name__}: {exc})"
                             ) from exc
        check_metadata(metadata)
    finally:
        if collecting:
            gc.enable()
    return metadata  # type: ignore[no-any-return]


# A crafted field may nest 100,000 lists deep or hold millions of items: shown bounded.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 4, 4, 4
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 60, 60, 40


def _bad(field: str, value: Any, expected: str) -> ValueError:
    seen = _SHOWN.repr(value)
    seen = seen if len(seen) <= 80 else seen[:77] + "..."
    if value is not None and type(value) not in (str, int):
        seen = f"a {type(value).__name__} {seen}"
    return ValueError(f"its {METADATA}: {field} is {seen}, where DCP writes {expected}")


def _index(value: Any, field: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(field, value, "an integer >= 0")


def _size(value: Any, field: str) -> None:
    if not isinstance(value, torch.Size):
        raise _bad(field, value, "a torch.Size")
    if min(value, default=0) < 0:  # torch.Size holds ints only (its constructor converts)
        i = next(i for i, n in enumerate(value) if n < 0)
        raise _bad(f"{field}[{i}]", value[i], "an integer >= 0")


def check_metadata(metadata: Any) -> None:
    """Raise ValueError naming the first field of `metadata` that DCP never writes so."""
    if not isinstance(metadata, Metadata):
        raise ValueError(f"its {METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict):
        raise _bad("state_dict_metadata", entries, "a dict")
    if not isinstance(storage, dict):
        raise _bad("storage_data", storage, "a dict")
    if not isinstance(metadata.storage_meta, StorageMeta | None):
        raise _bad("storage_meta", metadata.storage_meta, "a StorageMeta or None")
    if not isinstance(metadata.version, str | None):
        raise _bad("version", metadata.version, "a str or None")
    checked: set[int] = set()  # entries shared by keys (ids: all alive in `metadata`)
    chunks, whole = 0, coverage.Coverage()
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise _bad(f"state_dict_metadata key {_SHOWN.repr(key)}", key, "a str")
        if len(key) > MAX_KEY:
            raise _bad(f"a state_dict_metadata key of {len(key)} characters", key[:40],
                       f"keys of at most {MAX_KEY} characters (a module path)")
        field = f"state_dict_metadata[{key!r}]"
        chunks += _count_chunks(entry, field)
        if chunks > MAX_CHUNKS:
            raise ValueError(f"its {METADATA}: {field} brings its tensors' chunks to {chunks}, "
                             f"more than the {MAX_CHUNKS} a file may hold (a save writes one "
                             f"per tensor and rank holding part of it; keys sharing an entry "
                             f"count it each): the file was altered or damaged, and nothing "
                             f"is loaded")
        if id(entry) not in checked:
            _check_entry(entry, field, whole)
            checked.add(id(entry))
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _bad("storage_data key", index, "a MetadataIndex naming a key")
        if index.offset is not None:
            _size(index.offset, f"storage_data key {index.fqn!r} offset")
        if index.index is not None:
            _index(index.index, f"storage_data key {index.fqn!r} index")
        field = f"storage_data[{index.fqn!r}]"
        name = getattr(info, "relative_path", None)
        if (not isinstance(info, _StorageInfo) or not isinstance(name, str)
                or name in ("", ".", "..", METADATA) or "/" in name or "\x00" in name
                or os.sep in name or (os.altsep is not None and os.altsep in name)):
            raise _bad(f"{field}.relative_path", name, "the name of a shard file inside the "
                       "directory (nothing outside it is read)")
        _index(getattr(info, "offset", None), f"{field}.offset")
        _index(getattr(info, "length", None), f"{field}.length")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not (isinstance(transforms, list | tuple)
                                           and all(isinstance(t, str) for t in transforms)):
            raise _bad(f"{field}.transform_descriptors", transforms, "a list of str or None")
    _check_stored(entries, storage)


def _check_stored(entries: dict[str, Any], storage: dict[MetadataIndex, Any]) -> None:
    """Every chunk (and every saved object) has its bytes somewhere: DCP would raise a
    KeyError for one that has none, part-way through a load."""
    # MetadataIndex compares and hashes as (fqn, offset): the same lookups, a tenth the cost
    stored = {(index.fqn, index.offset) for index in storage}
    for key, entry in entries.items():
        places = ([(key, c.offsets) for c in entry.chunks]
                  if isinstance(entry, TensorStorageMetadata) else [(key, None)])
        for i, place in enumerate(places):
            if place not in stored:
                what = f".chunks[{i}]" if isinstance(entry, TensorStorageMetadata) else ""
                raise ValueError(f"its {METADATA}: state_dict_metadata[{key!r}]{what} has no "
                                 f"entry in storage_data (where its bytes are): the file was "
                                 f"altered or damaged")


def _count_chunks(entry: Any, field: str) -> int:
    """How many chunks `entry` holds (0 for saved bytes), within `MAX_TENSOR_CHUNKS`."""
    if isinstance(entry, BytesStorageMetadata):
        return 0
    if not isinstance(entry, TensorStorageMetadata):
        raise _bad(field, entry, "a TensorStorageMetadata or BytesStorageMetadata")
    if not isinstance(entry.chunks, list):
        raise _bad(f"{field}.chunks", entry.chunks, "a list")
    if len(entry.chunks) > MAX_TENSOR_CHUNKS:
        raise ValueError(f"its {METADATA}: {field}.chunks holds {len(entry.chunks)} chunks, "
                         f"more than the {MAX_TENSOR_CHUNKS} a tensor may have (a save writes "
                         f"one per rank holding part of it): the file was altered or damaged, "
                         f"and nothing is loaded")
    return len(entry.chunks)


def _check_entry(entry: Any, field: str, whole: coverage.Coverage) -> None:
    """The fields of one entry (`_count_chunks` has checked its kind and its chunk list)."""
    if isinstance(entry, BytesStorageMetadata):
        return
    _size(entry.size, f"{field}.size")
    if not isinstance(entry.properties, TensorProperties) or not isinstance(
            entry.properties.dtype, torch.dtype):
        raise _bad(f"{field}.properties", entry.properties, "TensorProperties with a dtype")
    for i, chunk in enumerate(entry.chunks):
        where = f"{field}.chunks[{i}]"
        if not isinstance(chunk, ChunkStorageMetadata):
            raise _bad(where, chunk, "a ChunkStorageMetadata")
        _size(chunk.offsets, f"{where}.offsets")
        _size(chunk.sizes, f"{where}.sizes")
        if not len(chunk.offsets) == len(chunk.sizes) == len(entry.size) or any(
                o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size,
                                             strict=True)):
            raise _bad(where, chunk, f"a chunk within the tensor's size {tuple(entry.size)}")
    gap = whole.uncovered(entry.size, [(c.offsets, c.sizes) for c in entry.chunks])
    if gap is not None:
        raise ValueError(f"its {METADATA}: {field}.chunks do not describe the whole tensor "
                         f"(size {tuple(entry.size)}): {gap}, where DCP writes chunks that "
                         f"cover each element once; the file was altered or damaged, and "
                         f"nothing is loaded")


def shard_ends(metadata: Metadata) -> dict[str, int]:
    """Each shard file the (checked) metadata names, and the byte its entries need it to reach."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = info.relative_path
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    return needed


class _HeldFile(io.RawIOBase):
    """A read-only view of a descriptor held open elsewhere, with its own position (pread):
    closing it leaves the descriptor open."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd, self._position = fd, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = os.pread(self._fd, len(view), self._position)
        view[:len(data)] = data
        self._position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position,
                io.SEEK_END: os.fstat(self._fd).st_size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position


class Replaced(Exception):
    """A file of the checkpoint being loaded vanished: a save replaced its directory (and
    removed the old files) meanwhile. The load starts again from the new one."""


class _HeldFiles(FileSystem):
    """DCP's file system over the shard files the metadata names: those held open, else
    opened one at a time from the held checkpoint directory through the file gate (never by
    a path from the top: what is at the checkpoint's path now is never read)."""

    def __init__(self, directory: int, names: set[str], held: dict[str, int]) -> None:
        super().__init__()
        self._directory, self._names, self._held = directory, names, held

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        name = os.path.basename(os.fspath(path))
        if mode != "rb" or name not in self._names:
            raise PermissionError(f"{name!r} ({mode}): a load reads only the checkpoint's "
                                  f"shard files")
        if name in self._held:
            with io.BufferedReader(_HeldFile(self._held[name])) as stream:
                yield stream
            return
        try:
            fd = files.open_in(self._directory, name, shown=name)
        except FileNotFoundError:
            raise Replaced(name) from None
        try:
            with io.BufferedReader(_HeldFile(fd)) as stream:
                yield stream
        finally:
            os.close(fd)


class Reader(FileSystemReader):
    """DCP's file-system reader over a checkpoint opened once: its checked metadata, and the
    shard files it names: those in `held` (name -> descriptor), else opened from the held
    `directory` (descriptors the caller owns)."""

    def __init__(self, path: str, metadata: Metadata, directory: int,
                 held: dict[str, int]) -> None:
        super().__init__(path)
        self.fs = _HeldFiles(directory, set(shard_ends(metadata)), held)
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except AssertionError as exc:  # DCP's own check of a chunk's size, or a bug: unnamed
            read = getattr(planner, "resolved", None)
            if read is None:
                raise
            raise ValueError(self._other_size(read)) from exc

    def _other_size(self, read: ReadItem) -> str:
        """The tensor DCP read for `read` (just resolved) had another size than its chunk: a
        storage entry that points at another tensor's bytes, which only reading shows."""
        index = read.storage_index
        chunks = getattr(self._metadata.state_dict_metadata[index.fqn], "chunks", [])
        sizes = next((c.sizes for c in chunks if c.offsets == index.offset), read.lengths)
        info = self._metadata.storage_data[index]
        return (f"the bytes that its {METADATA} names for {index.fqn!r} (its chunk at offsets "
                f"{tuple(index.offset or ())}, sizes {tuple(sizes)}) hold a tensor of another "
                f"size ({info.length} bytes at {info.offset} of {info.relative_path!r}): the "
                f"files were altered or damaged")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's default load planner, reading saved objects (not tensors) with weights_only=True."""

    resolved: ReadItem | None = None  # the tensor read being copied in, for its errors

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        self.resolved = read_item
        tensor: torch.Tensor = super().resolve_tensor(read_item)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.resolved = None
        super().commit_tensor(read_item, tensor)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Refuse anything beyond plain data first; then torch's own load (weights_only=False)
        # sees only what weights_only accepted.
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)
