"""Crafted `.metadata` of many keys or chunks: judged in time that follows its size, and every
refusal names the file's problem."""

from __future__ import annotations

import copy
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from pipeline import PipeConfigError
from pipeline.state import coverage, shard_reader
from tests.pipeline.sharded_workers import load_fresh, save_trained

# Each case here took minutes before: 10 s is a generous bound on a loaded machine.
LIMIT_S = 10


def _craft(path: Path, change: Callable[[Metadata], None]) -> int:
    """Rewrite the `.metadata` of the checkpoint at `path` as DCP writes it (pickled), after
    `change`; its size in bytes."""
    metadata: Metadata = pickle.loads((path / ".metadata").read_bytes())  # our own: trusted
    change(metadata)
    data = pickle.dumps(metadata)
    (path / ".metadata").write_bytes(data)
    return len(data)


def _refused_in_time(path: Path, match: str) -> str:
    started = time.monotonic()
    with pytest.raises(PipeConfigError, match=match) as err:
        load_fresh(path)
    took = time.monotonic() - started
    assert took < LIMIT_S, f"refused after {took:.1f} s"
    assert "AssertionError" not in str(err.value)
    return str(err.value)


def _shared_keys(count: int, entry_of: Callable[[Metadata], Any], stored: bool
                 ) -> Callable[[Metadata], None]:
    """`count` new keys sharing one entry object (pickled once, as a reference each); with
    `stored`, each chunk of each key has its storage entry (the bytes of `model.3.weight`)."""
    def change(m: Metadata) -> None:
        entry = entry_of(m)
        info = m.storage_data[MetadataIndex("model.3.weight", torch.Size([0, 0]))]
        for i in range(count):
            m.state_dict_metadata[f"model.extra.{i}"] = entry
            if stored:
                for chunk in entry.chunks:
                    m.storage_data[MetadataIndex(f"model.extra.{i}", chunk.offsets)] = info
    return change


def _grid(m: Metadata, side: int) -> TensorStorageMetadata:
    """A `side` x `side` tensor in `side` x `side` chunks of one element each."""
    properties = m.state_dict_metadata["model.3.weight"].properties  # type: ignore[union-attr]
    return TensorStorageMetadata(properties, torch.Size([side, side]), [
        ChunkStorageMetadata(torch.Size([i, j]), torch.Size([1, 1]))
        for i in range(side) for j in range(side)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("keys", [100_000, 400_000])
def test_many_keys_sharing_one_entry_are_refused_in_time(tmp_path: Path, keys: int) -> None:
    """100k keys sharing one entry (2.7 MB) took 27.6 s to refuse, 400k (11 MB) 190 s: each
    key's chunks were checked again."""
    save_trained(tmp_path)
    size = _craft(tmp_path, _shared_keys(keys, lambda m: m.state_dict_metadata["model.3.weight"],
                                         stored=False))
    assert size > keys * 20  # a reference per key, not a copy
    _refused_in_time(tmp_path, r"\.metadata: state_dict_metadata\['model\.extra\.0'\]\.chunks"
                               r"\[0\] has no entry in storage_data")


@pytest.mark.timeout(300)
def test_keys_sharing_one_entry_each_stored_are_accepted_in_time(tmp_path: Path) -> None:
    """Keys may share an entry if each has its bytes: the metadata is sound (the load then
    finds keys this model lacks)."""
    save_trained(tmp_path)
    _craft(tmp_path, _shared_keys(200_000, lambda m: m.state_dict_metadata["model.3.weight"],
                                  stored=True))
    started = time.monotonic()
    metadata = shard_reader.unpickle_metadata((tmp_path / ".metadata").read_bytes())
    assert len(metadata.state_dict_metadata) > 200_000
    assert time.monotonic() - started < LIMIT_S
    _refused_in_time(tmp_path, r"model keys unexpected \['extra\.0', .* and 199996 more")


@pytest.mark.timeout(300)
def test_keys_sharing_an_entry_of_many_chunks_are_refused_at_the_bound(tmp_path: Path) -> None:
    """500 keys sharing one entry of 64 x 64 chunks (303 kB) took 193 s to refuse."""
    save_trained(tmp_path)
    _craft(tmp_path, _shared_keys(500, lambda m: _grid(m, 64), stored=False))
    _refused_in_time(tmp_path, rf"\.metadata: state_dict_metadata\['model\.extra\.\d+'\] "
                               rf"brings its tensors' chunks to \d+, more than the "
                               rf"{shard_reader.MAX_CHUNKS}")


def test_a_tensor_of_too_many_chunks_is_refused_at_the_bound(tmp_path: Path) -> None:
    save_trained(tmp_path)

    def change(m: Metadata) -> None:
        entry = m.state_dict_metadata["model.3.weight"]
        entry.chunks = entry.chunks * (shard_reader.MAX_TENSOR_CHUNKS + 1)  # type: ignore[union-attr]

    _craft(tmp_path, change)
    _refused_in_time(tmp_path, rf"state_dict_metadata\['model\.3\.weight'\]\.chunks holds "
                               rf"{shard_reader.MAX_TENSOR_CHUNKS + 1} chunks, more than the "
                               rf"{shard_reader.MAX_TENSOR_CHUNKS}")


def test_a_tensor_in_a_grid_of_many_chunks_is_accepted_in_time() -> None:
    """A save's chunks form a grid: 256 x 256 of them are checked in time that follows them."""
    chunks = [((i, j), (1, 1)) for i in range(256) for j in range(256)]
    started = time.monotonic()
    assert coverage.Coverage().uncovered((256, 256), chunks) is None
    chunks[1000] = chunks[1001]
    assert coverage.Coverage().uncovered((256, 256), chunks) == (
        "its part [3:4, 233:234] is in more than one chunk")
    del chunks[1000]
    assert coverage.Coverage().uncovered((256, 256), chunks) == (
        "its part [3:4, 232:233] is in no chunk")
    assert time.monotonic() - started < LIMIT_S


def _staircase(side: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """A `side` x `side` tensor tiled by rows, each row cut at its own column: its chunks are
    no grid, and cut it into `side` x `side` pieces."""
    return [box for i in range(side)
            for box in (((i, 0), (1, i + 1)), ((i, i + 1), (1, side - i - 1))) if box[1][1]]


def test_chunks_that_cut_tensors_into_too_many_pieces_are_refused_at_the_bound() -> None:
    checker = coverage.Coverage()
    started = time.monotonic()
    assert checker.uncovered((1024, 1024), _staircase(1024)) is None  # 1M pieces: a valid tiling
    for _ in range(3):  # 4 M pieces in all: the bound
        assert checker.uncovered((1024, 1024), _staircase(1024)) is None
    assert checker.uncovered((1024, 1024), _staircase(1024)) == (
        f"its 2047 chunks cut it into 1048576 pieces, and the file's tensors into more than "
        f"the {coverage.MAX_PIECES} a file's chunks may (a save's cut each tensor into one "
        f"piece per chunk)")
    assert time.monotonic() - started < LIMIT_S


def _brute(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
           ) -> np.ndarray:
    count = np.zeros(size, dtype=np.int64)
    for offsets, sizes in chunks:
        count[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
    return count


@st.composite
def _tensors(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Any]]:
    size = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    box = st.tuples(*(st.integers(0, n) for n in size)).flatmap(
        lambda lo: st.tuples(st.just(lo), st.tuples(
            *(st.integers(0, n - o) for o, n in zip(lo, size, strict=True)))))
    tiles = [((0,) * len(size), size)]
    for _ in range(draw(st.integers(0, 4))):  # split a tile in two: a valid tiling, not a grid
        i = draw(st.integers(0, len(tiles) - 1))
        (lo, extent), dims = tiles[i], [d for d, n in enumerate(tiles[i][1]) if n > 1]
        if dims:
            d = draw(st.sampled_from(dims))
            cut = draw(st.integers(1, extent[d] - 1))
            tiles[i:i + 1] = [(lo, (*extent[:d], cut, *extent[d + 1:])),
                              ((*lo[:d], lo[d] + cut, *lo[d + 1:]),
                               (*extent[:d], extent[d] - cut, *extent[d + 1:]))]
    chunks = draw(st.one_of(st.just(tiles), st.lists(box, max_size=6),
                            st.lists(st.sampled_from(tiles) | box, max_size=6)))
    return size, chunks


@given(_tensors())
def test_the_check_agrees_with_counting_every_element(tensor: tuple[Any, list[Any]]) -> None:
    size, chunks = tensor
    count = _brute(size, chunks)
    found = coverage.Coverage().uncovered(size, chunks)
    if found is None:
        assert (count == 1).all()
        return
    assert not (count == 1).all()
    want = 0 if found.endswith("is in no chunk") else 2
    if "[" not in found:  # the one element of a tensor of no dimensions
        assert (count.item() == 0) if want == 0 else (count.item() > 1)
        return
    part = found[found.index("[") + 1:found.index("]")]
    ranges = [tuple(map(int, r.split(":"))) for r in part.split(", ")]
    cells = count[tuple(slice(a, b) for a, b in ranges)]
    assert (cells == 0).all() if want == 0 else (cells > 1).all()
    if want == 2:
        return
    assert (count > 1).sum() == 0  # an overlap is named before a gap


def test_bytes_of_another_size_are_named_not_an_assertion(tmp_path: Path) -> None:
    """A chunk whose storage entry points at a smaller tensor's bytes failed deep in DCP with
    `AssertionError: req MetadataIndex(...) mismatch sizes`."""
    save_trained(tmp_path)

    def change(m: Metadata) -> None:
        smaller = m.storage_data[MetadataIndex("model.5.weight", torch.Size([0, 0]))]
        m.storage_data[MetadataIndex("model.3.weight", torch.Size([0, 0]))] = copy.copy(smaller)

    _craft(tmp_path, change)
    message = _refused_in_time(tmp_path, r"damaged: reading it failed")
    assert ("the bytes that its .metadata names for 'model.3.weight' (its chunk at offsets "
            "(0, 0), sizes (16, 16)) hold a tensor of another size" in message), message

