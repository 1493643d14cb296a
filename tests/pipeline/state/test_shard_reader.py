"""Reading a checkpoint that is not trusted: file kinds, links, crafted metadata, old pickles."""

from __future__ import annotations

import contextlib
import copy
import enum
import io
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from pipeline import PipeConfigError
from pipeline.state import sharded
from tests.pipeline.sharded_workers import (
    assert_same,
    load_fresh,
    model,
    save_trained,
)
from tests.strategies import crafted_checkpoints


def _metadata(path: Path) -> Metadata:
    loaded: Metadata = pickle.loads((path / ".metadata").read_bytes())  # our own: trusted
    return loaded


def _rewrite(path: Path, change: Callable[[Metadata], None]) -> None:
    metadata = _metadata(path)
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def _first(mapping: dict[Any, Any]) -> Any:
    return next(iter(mapping))


# -- links and file kinds -------------------------------------------------------------------------
def test_a_shard_linked_to_another_checkpoint_is_refused(tmp_path: Path) -> None:
    save_trained(tmp_path / "private", seed=1)
    save_trained(tmp_path / "ckpt", seed=0)
    (shard,) = (tmp_path / "ckpt").glob("*.distcp")
    shard.unlink()
    shard.symlink_to(tmp_path / "private" / shard.name)
    with pytest.raises(PipeConfigError, match=rf"'{shard.name}' is a symbolic link"):
        load_fresh(tmp_path / "ckpt")


@pytest.mark.timeout(60)  # a load that blocks on the FIFO would hang: fail instead
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_metadata_file_of_another_kind_is_refused_without_reading(tmp_path: Path,
                                                                    kind: str) -> None:
    path = tmp_path / "ckpt"
    save_trained(path)
    (path / ".metadata").rename(tmp_path / "elsewhere")
    if kind == "fifo":
        os.mkfifo(path / ".metadata")
    elif kind == "directory":
        (path / ".metadata").mkdir()
    else:
        (path / ".metadata").symlink_to(tmp_path / "elsewhere")
    what = {"fifo": "a FIFO", "directory": "a directory", "symlink": "a symbolic link"}[kind]
    with pytest.raises(PipeConfigError, match=rf"\.metadata' is {what}, not a regular file"):
        load_fresh(path)


@pytest.mark.timeout(60)
def test_a_shard_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_trained(path)
    (shard,) = path.glob("*.distcp")
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(PipeConfigError, match=rf"'{shard.name}' is a FIFO, not a regular file"):
        load_fresh(path)


# -- crafted metadata -----------------------------------------------------------------------------
def _storage(metadata: Metadata) -> Any:
    return metadata.storage_data[_first(metadata.storage_data)]


@pytest.mark.parametrize(("change", "field"), [
    (lambda m: setattr(_storage(m), "relative_path", "__0\x000.distcp"), r"relative_path"),
    (lambda m: setattr(_storage(m), "offset", "12"), r"\.offset is '12'"),
    (lambda m: setattr(_storage(m), "length", -1), r"\.length is -1"),
    (lambda m: setattr(m, "state_dict_metadata", list(m.state_dict_metadata.values())),
     r"state_dict_metadata is a list"),
    (lambda m: setattr(m, "storage_data", list(m.storage_data.values())),
     r"storage_data is a list"),
    (lambda m: m.state_dict_metadata.update({7: m.state_dict_metadata["model.0.weight"]}),
     r"state_dict_metadata key 7"),
    (lambda m: setattr(m.state_dict_metadata["model.0.weight"], "size", "big"),
     r"state_dict_metadata\['model.0.weight'\]\.size"),
])
def test_crafted_metadata_is_named_by_file_and_field(tmp_path: Path, change: Any,
                                                     field: str) -> None:
    save_trained(tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(PipeConfigError, match=r"\.metadata: .*" + field):
        load_fresh(tmp_path)


def _apply(metadata: Metadata, field: str, value: Any) -> None:
    """Put `value` where `field` of `metadata` is (the first entry's, for per-entry fields)."""
    key = _first(metadata.state_dict_metadata)
    index = _first(metadata.storage_data)
    info = metadata.storage_data[index]
    tensor = next(v for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))
    if field in ("state_dict_metadata", "storage_data", "storage_meta", "version",
                 "planner_data"):
        setattr(metadata, field, value)
    elif field == "entry":
        metadata.state_dict_metadata[key] = value
    elif field == "key":
        metadata.state_dict_metadata[value] = metadata.state_dict_metadata.pop(key)
    elif field in ("size", "chunks", "properties"):
        setattr(tensor, field, value)
    elif field.startswith("chunk."):
        object.__setattr__(tensor.chunks[0], field[len("chunk."):], value)
    elif field == "index":
        metadata.storage_data[value] = metadata.storage_data.pop(index)
    elif field.startswith("index."):
        new = copy.copy(index)
        object.__setattr__(new, field[len("index."):], value)
        metadata.storage_data[new] = metadata.storage_data.pop(index)
    else:
        setattr(info, field, value)


def _make(path: Path, kind: str, content: bytes, outside: Path) -> None:
    """Turn `path` into a file of `kind` (see tests.strategies.FILE_KINDS)."""
    path.unlink()
    if kind in ("regular", "cut", "garbage", "empty"):
        data = {"regular": content, "cut": content[: len(content) // 2],
                "garbage": bytes(range(256)) * 4, "empty": b""}[kind]
        path.write_bytes(data)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink-inside":
        (path.parent / "inside").write_bytes(content)
        path.symlink_to(path.parent / "inside")
    elif kind == "symlink-outside":
        path.symlink_to(outside)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "ckpt"
    save_trained(path)
    return path


@pytest.mark.timeout(600)  # a hang in any example fails the test rather than the suite
@given(crafted=crafted_checkpoints())
def test_crafted_checkpoints_raise_only_pipe_config_error(template: Path,
                                                          crafted: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "ckpt"
        shutil.copytree(template, path)
        try:
            metadata = _metadata(path)
            for field, value in crafted["mutations"]:
                _apply(metadata, field, value)
            content = pickle.dumps(metadata)
        except Exception:  # a mutation that cannot even be pickled: keep DCP's file
            content = (path / ".metadata").read_bytes()
        (path / ".metadata").write_bytes(content)
        (shard,) = path.glob("*.distcp")
        _make(path / ".metadata", crafted["metadata"], content, template / ".metadata")
        _make(shard, crafted["shard"], (template / shard.name).read_bytes(),
              template / shard.name)
        with contextlib.suppress(PipeConfigError):  # loading, or this: nothing else
            load_fresh(path)


# -- metadata that must describe the whole ------------------------------------------------------
def _set_chunks(metadata: Metadata, key: str, chunks: list[tuple[int, int]]) -> None:
    """Give tensor `key` (16 x 16) chunks of these (first row, rows) each; each chunk's bytes
    where the first chunk's were (its storage entry copied)."""
    entry = metadata.state_dict_metadata[key]
    first = entry.chunks[0]  # type: ignore[union-attr]
    stored = metadata.storage_data[MetadataIndex(key, first.offsets)]
    entry.chunks = [ChunkStorageMetadata(torch.Size([row, 0]), torch.Size([rows, 16]))  # type: ignore[union-attr]
                    for row, rows in chunks]
    for c in entry.chunks:  # type: ignore[union-attr]
        metadata.storage_data[MetadataIndex(key, c.offsets)] = stored


@pytest.mark.parametrize(("chunks", "gap"), [
    ([(0, 8)], r"its part \[8:16, 0:16\] is in no chunk"),
    ([], r"its part \[0:16, 0:16\] is in no chunk"),
    ([(0, 16), (4, 4)], r"its part \[4:8, 0:16\] is in more than one chunk"),
])
def test_chunks_that_do_not_cover_a_tensor_once_are_refused_and_nothing_loads(
        tmp_path: Path, chunks: list[tuple[int, int]], gap: str) -> None:
    """Chunks covering half of `3.weight` left its other half at the model's own values, and
    an empty chunk list all of it: no error."""
    path = tmp_path / "ckpt"
    save_trained(path)
    _rewrite(path, lambda m: _set_chunks(m, "model.3.weight", chunks))
    target = model(9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(PipeConfigError, match=r"\['model\.3\.weight'\]\.chunks do not describe "
                                              r"the whole tensor \(size \(16, 16\)\): " + gap):
        sharded.load(target, path)
    assert_same(dict(target.state_dict()), before, "the model, unchanged")


def test_a_chunk_with_no_bytes_stored_is_refused_before_loading(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_trained(path)
    _rewrite(path, lambda m: m.storage_data.pop(MetadataIndex("model.3.weight",
                                                              torch.Size([0, 0]))))
    with pytest.raises(PipeConfigError, match=r"\['model\.3\.weight'\]\.chunks\[0\] has no "
                                              r"entry in storage_data"):
        load_fresh(path)


# -- metadata of any size, depth and number of keys ----------------------------------------------
@pytest.mark.timeout(60)
def test_a_key_of_many_dots_is_refused_at_once(tmp_path: Path) -> None:
    """An optimizer key of n dots made a load quadratic (400k dots: 35 s)."""
    path = tmp_path / "ckpt"
    save_trained(path)
    key = "optim.state.3.weight" + "." * 400_000 + "x"
    _rewrite(path, lambda m: m.state_dict_metadata.update(
        {key: m.state_dict_metadata["optim.state.3.weight.exp_avg"]}))
    started = time.monotonic()
    with pytest.raises(PipeConfigError, match=r"a state_dict_metadata key of 400021 characters"):
        load_fresh(path)
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_a_huge_sparse_metadata_file_is_refused_without_reading(tmp_path: Path) -> None:
    """A 64 GiB sparse `.metadata` was read whole (MemoryError after 40 s under a 6 GiB cap)."""
    path = tmp_path / "ckpt"
    save_trained(path)
    with open(path / ".metadata", "r+b") as f:
        f.truncate(64 << 30)
    with pytest.raises(PipeConfigError, match=r"'\.metadata' holds 68719476736 bytes, more "
                                              r"than the 1073741824"):
        load_fresh(path)


@pytest.mark.timeout(60)
def test_a_field_nested_100k_deep_is_named(tmp_path: Path) -> None:
    """A 100k-deep field in `.metadata` (200 kB) raised RecursionError."""
    path = tmp_path / "ckpt"
    save_trained(path)
    metadata = _metadata(path)
    metadata.version = "DEEPDEEP"
    # [[[...]]] 100,000 deep, as pickle opcodes: that many empty lists, each appended to the
    # one below (pickling such a list here would overflow the C stack).
    deep = b"]" * 100_000 + b"a" * 99_999
    (path / ".metadata").write_bytes(pickle.dumps(metadata).replace(b"\x8c\x08DEEPDEEP", deep))
    with pytest.raises(PipeConfigError, match=r"version is a list \[+\.\.\.\]+, where DCP"):
        load_fresh(path)


def test_many_unexpected_keys_make_a_short_message(tmp_path: Path) -> None:
    """200k unexpected keys made a 2.1 MB error message: it grew with the keys (20k would
    have made 210 kB), so 20k show that it no longer does."""
    path = tmp_path / "ckpt"
    save_trained(path)

    def extra(m: Metadata) -> None:
        stored = m.storage_data[MetadataIndex("model.0.bias", torch.Size([0]))]
        for i in range(20_000):
            m.state_dict_metadata[f"model.extra.{i}"] = m.state_dict_metadata["model.0.bias"]
            m.storage_data[MetadataIndex(f"model.extra.{i}", torch.Size([0]))] = stored

    _rewrite(path, extra)
    with pytest.raises(PipeConfigError, match=r"model keys unexpected \['model\.extra|"
                                              r"model keys unexpected \['extra") as err:
        load_fresh(path)
    assert len(str(err.value)) < 2000 and "and 19996 more" in str(err.value)


# -- pickles of older Pythons ---------------------------------------------------------------------
class _GetattrEnums(pickle.Pickler):
    """Pickles enum members as Python 3.11.0-3.11.3 did: `builtins.getattr(cls, name)`."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_pickled_by_python_3_11_2_loads(tmp_path: Path) -> None:
    expected = save_trained(tmp_path)
    buffer = io.BytesIO()
    _GetattrEnums(buffer).dump(_metadata(tmp_path))
    assert b"getattr" in buffer.getvalue() and b"_MEM_FORMAT_ENCODING" in buffer.getvalue()
    (tmp_path / ".metadata").write_bytes(buffer.getvalue())
    assert_same(load_fresh(tmp_path), expected, "metadata with enums pickled by getattr")


# GLOBAL builtins getattr, GLOBAL <module> <class>, the name, TUPLE2, REDUCE, STOP.
def _getattr_pickle(module: str, cls: str, name: str) -> bytes:
    text = name.encode()
    return (b"\x80\x02cbuiltins\ngetattr\nc" + f"{module}\n{cls}\n".encode()
            + b"X" + len(text).to_bytes(4, "little") + text + b"\x86R.")


@pytest.mark.parametrize(("module", "cls", "name"), [
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "__class__"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "_missing_"),
    ("torch.distributed.checkpoint.metadata", "Metadata", "__reduce__"),
    ("torch", "Size", "__new__"),
])
def test_getattr_in_metadata_is_refused_but_for_enum_members(tmp_path: Path, module: str,
                                                            cls: str, name: str) -> None:
    save_trained(tmp_path)
    (tmp_path / ".metadata").write_bytes(_getattr_pickle(module, cls, name))
    with pytest.raises(PipeConfigError, match=rf"getattr\(.*{cls}.*'{name}'\).*refused"):
        load_fresh(tmp_path)
    member = _getattr_pickle("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING",
                             "TORCH_CONTIGUOUS_FORMAT")
    (tmp_path / ".metadata").write_bytes(member)
    with pytest.raises(PipeConfigError, match=r"holds a _MEM_FORMAT_ENCODING, not DCP metadata"):
        load_fresh(tmp_path)
