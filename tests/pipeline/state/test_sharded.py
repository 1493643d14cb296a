"""Sharded (DCP) checkpoints: saved under one layout, loaded bitwise under another."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe, PipeConfigError
from pipeline.launch import spawn
from pipeline.state import opened, sharded, staging
from tests.limits import DIST_TEST_TIMEOUT, SPAWN_TIMEOUT
from tests.pipeline.in_turn import run_in_turn
from tests.pipeline.sharded_workers import (
    adam,
    assert_same,
    batch,
    load_continue,
    model,
    snapshot,
    train_save_continue,
    train_step,
    unpack,
)

# chunks=1 throughout: a Pipe's step then does what the plain model's forward and backward do,
# op for op (BatchNorm sees the whole batch), so even the step after loading is bitwise equal.


def _threads(balance: list[int], seed: int) -> Pipe:
    return Pipe(model(seed), balance, devices=["cpu"] * len(balance))


def _load_and_step(module: nn.Module, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load into `module` (and a fresh Adam with another lr), then one step: both snapshots."""
    optimizer = adam(module, lr=0.5)
    sharded.load(module, path, optimizer)
    loaded = snapshot(module, optimizer)
    train_step(module, optimizer, 1)
    return loaded, snapshot(module, optimizer)


def test_threads_to_another_balance_and_to_one_device(tmp_path: Path) -> None:
    pipe = _threads([2, 4], seed=0)
    optimizer = adam(pipe)
    train_step(pipe, optimizer, 0)
    sharded.save(pipe, tmp_path, optimizer)
    saved = snapshot(pipe, optimizer)
    assert any(k.endswith(": exp_avg_sq") for k in saved) and "2.running_mean" in saved
    train_step(pipe, optimizer, 1)
    continued = snapshot(pipe, optimizer)
    for what, target in (("balance [4, 1, 1]", _threads([4, 1, 1], seed=1)),
                         ("nn.Sequential", model(2))):
        loaded, stepped = _load_and_step(target, tmp_path)
        assert_same(loaded, saved, what)  # weights, buffers, Adam state and lr
        assert_same(stepped, continued, f"{what}, one step later")


def test_plain_model_to_threads(tmp_path: Path) -> None:
    plain = model(0)
    optimizer = adam(plain)
    train_step(plain, optimizer, 0)
    sharded.save(plain, tmp_path, optimizer)
    saved = snapshot(plain, optimizer)
    loaded, _ = _load_and_step(_threads([3, 3], seed=4), tmp_path)
    assert_same(loaded, saved, "threads")


def test_weights_only(tmp_path: Path) -> None:
    pipe = _threads([3, 3], seed=0)
    sharded.save(pipe, tmp_path)
    plain = model(5)
    sharded.load(plain, tmp_path)
    assert_same(dict(plain.state_dict()), dict(pipe.state_dict()), "weights")
    with pytest.raises(PipeConfigError, match=r"no optimizer state .*load without optimizer="):
        sharded.load(plain, tmp_path, adam(plain))


def test_misfits_are_named(tmp_path: Path) -> None:
    pipe = _threads([2, 4], seed=0)
    optimizer = adam(pipe)
    train_step(pipe, optimizer, 0)
    sharded.save(pipe, tmp_path, optimizer)
    before = snapshot(pipe, optimizer)
    bigger = model(1, extra=True)
    with pytest.raises(PipeConfigError, match=r"saved from a Pipe with balance \[2, 4\], Adam "
                                              r"state.* model keys missing \['6.bias', "
                                              r"'6.weight'\]"):
        sharded.load(bigger, tmp_path)
    smaller = nn.Sequential(*list(model(1))[:5])
    with pytest.raises(PipeConfigError, match=r"model keys unexpected \['5.bias', '5.weight'\]"):
        sharded.load(smaller, tmp_path)
    wider = nn.Sequential(*list(model(1))[:5], nn.Linear(16, 4))
    with pytest.raises(PipeConfigError, match=r"'5.weight': checkpoint \(3, 16\), here \(4, 16\)"):
        sharded.load(wider, tmp_path)
    sgd = torch.optim.SGD(model(1).parameters(), lr=0.1, momentum=0.9)
    target = model(1)
    with pytest.raises(PipeConfigError, match="not the module's"):
        sharded.load(target, tmp_path, sgd)
    with pytest.raises(PipeConfigError, match=r"optimizer keys missing .*'param_groups.0.bias."
                                              r"dampening'"):
        sharded.load(target, tmp_path, torch.optim.SGD(target.parameters(), lr=0.1))
    x, y = batch(0)
    nn.MSELoss()(target(x), y).backward()  # gradients, no state: torch would not create it
    with pytest.raises(PipeConfigError, match=r"no slot for the saved \['state.0.bias.exp_avg'"):
        sharded.load(target, tmp_path, adam(target))
    with pytest.raises(PipeConfigError, match=r"nothing to load at .*no \.metadata"):
        sharded.load(target, tmp_path / "absent")
    assert_same(snapshot(pipe, optimizer), before, "the saved Pipe")


# -- several processes --------------------------------------------------------------------------
@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Compute as the spawned ranks do (one intra-op thread each): matrix products then sum in
    the same order, so a step here gives the same bits as a step there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _saved_and_continued(results: list[tuple[bytes, bytes]]
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
    return unpack([r[0] for r in results]), unpack([r[1] for r in results])


@pytest.fixture(scope="module")
def across_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two tests below, in 3 spawns instead of 4: 2 processes train and save; 4 load that
    and one step later, then (in turn, on the same ranks) train and save themselves; 2 load
    what the 4 saved. Each test checks its own half."""
    by_two, by_four = tmp_path_factory.mktemp("by-two"), tmp_path_factory.mktemp("by-four")
    saved_by_two = spawn(train_save_continue, 2, str(by_two), [2, 4], timeout=SPAWN_TIMEOUT)
    on_four = spawn(run_in_turn, 4, [
        ("load", load_continue, (str(by_two), [1, 2, 2, 1], False)),
        ("save", train_save_continue, (str(by_four), [1, 2, 2, 1])),
    ], timeout=SPAWN_TIMEOUT)
    loaded_by_two = spawn(load_continue, 2, str(by_four), [4, 2], True, timeout=SPAWN_TIMEOUT)
    return {"saved by two": saved_by_two, "by two": by_two,
            "loaded by four": [r["load"] for r in on_four],
            "saved by four": [r["save"] for r in on_four], "loaded by two": loaded_by_two}


@pytest.mark.dist
@pytest.mark.timeout(3 * DIST_TEST_TIMEOUT)  # the fixture's three spawns
def test_two_processes_to_four_threads_and_one_device(across_processes: dict[str, Any]
                                                      ) -> None:
    tmp_path = across_processes["by two"]
    saved, continued = _saved_and_continued(across_processes["saved by two"])
    results = across_processes["loaded by four"]
    assert_same(unpack([r[1] for r in results]), saved, "4 processes")
    assert_same(unpack([r[2] for r in results]), continued, "4 processes, one step later")
    for what, target in (("threads", _threads([3, 2, 1], seed=1)), ("one device", model(2))):
        with _one_intra_op_thread():
            loaded, stepped = _load_and_step(target, tmp_path)
        assert_same(loaded, saved, what)
        assert_same(stepped, continued, f"{what}, one step later")


@pytest.mark.dist
@pytest.mark.timeout(3 * DIST_TEST_TIMEOUT)  # the fixture's three spawns
def test_four_processes_to_two(across_processes: dict[str, Any]) -> None:
    saved, continued = _saved_and_continued(across_processes["saved by four"])
    results = across_processes["loaded by two"]
    for error, _, _ in results:  # every rank raised, and names the rank that misses keys
        assert "over 4 processes" in error, error
        assert "rank 1: model keys missing ['6.bias', '6.weight']" in error, error
    assert_same(unpack([r[1] for r in results]), saved, "2 processes")
    assert_same(unpack([r[2] for r in results]), continued, "2 processes, one step later")


# -- a checkpoint directory is not trusted ------------------------------------------------------
def _saved_plain(path: Path) -> nn.Sequential:
    plain = model(0)
    optimizer = adam(plain)
    train_step(plain, optimizer, 0)
    sharded.save(plain, path, optimizer)
    return plain


def _shard(path: Path) -> Path:
    (shard,) = path.glob("*.distcp")
    return shard


def test_a_directory_that_is_no_checkpoint_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(PipeConfigError, match=r"nothing to load at .*no \.metadata file"):
        sharded.load(model(1), tmp_path)
    with pytest.raises(PipeConfigError, match=r"nothing to load at .*no \.metadata file"):
        sharded.load(model(1), tmp_path / "notes.txt")


@pytest.mark.parametrize(("content", "error"), [
    (b"", r"\.metadata cannot be read \(EOFError"),
    (b"\x80\x04garbage", r"\.metadata cannot be read \(UnpicklingError"),
    (pickle.dumps({"state_dict_metadata": {}}), r"\.metadata holds a dict, not DCP metadata"),
])
def test_an_unreadable_metadata_file_is_named(tmp_path: Path, content: bytes, error: str) -> None:
    _saved_plain(tmp_path)
    (tmp_path / ".metadata").write_bytes(content)
    with pytest.raises(PipeConfigError, match=r"nothing to load at .*" + error + r".*damaged"):
        sharded.load(model(1), tmp_path)


class _Payload:
    """Unpickling this would run `os.system`; the loader must refuse it."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (self.command,))


def test_no_pickle_in_a_checkpoint_runs_code(tmp_path: Path) -> None:
    _saved_plain(tmp_path)
    witness = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(f"touch {witness}")))
    with pytest.raises(PipeConfigError, match=r"refers to posix\.system.*refused"):
        sharded.load(model(1), tmp_path)
    assert not witness.exists()


def test_a_saved_object_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """The optimizer's hyperparameters are pickled objects in the shard: replaced by one that
    runs code (same length, so only the reading can tell), loading raises and runs nothing."""
    _saved_plain(tmp_path)
    witness = tmp_path / "ran"
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    shard = _shard(tmp_path)
    data = bytearray(shard.read_bytes())
    (key, info), *_ = [(k, v) for k, v in metadata.storage_data.items()
                       if k.fqn == "optim.param_groups.0.bias.lr"]
    buffer = io.BytesIO()
    torch.save(_Payload(f"touch {witness}"), buffer)
    payload = buffer.getvalue()
    info.length = len(payload)
    info.offset = len(data)
    shard.write_bytes(bytes(data) + payload)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    target = model(1)
    with pytest.raises(PipeConfigError, match=r"is damaged: reading it failed .*Weights only "
                                              r"load failed.*GLOBAL posix.system"):
        sharded.load(target, tmp_path, adam(target))
    assert not witness.exists(), key


def test_missing_and_cut_shards_are_named_before_anything_loads(tmp_path: Path) -> None:
    _saved_plain(tmp_path)
    target = model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    shard = _shard(tmp_path)
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    with pytest.raises(PipeConfigError, match=rf"'{shard.name}' is cut short \({size // 2} "
                                              rf"bytes; its entries need \d+\).*damaged"):
        sharded.load(target, tmp_path)
    shard.unlink()
    with pytest.raises(PipeConfigError, match=rf"shard file '{shard.name}' is missing"):
        sharded.load(target, tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_a_shard_damaged_within_its_length_is_named(tmp_path: Path) -> None:
    _saved_plain(tmp_path)
    shard = _shard(tmp_path)
    shard.write_bytes(bytes(shard.stat().st_size))  # zeros: torch.load finds no archive
    with pytest.raises(PipeConfigError, match=r"load: the checkpoint at .* is damaged: reading "
                                              r"it failed"):
        sharded.load(model(1), tmp_path)


def test_a_shard_named_outside_the_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _saved_plain(path)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../" + info.relative_path
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(PipeConfigError, match=r"\.metadata: storage_data\[.*\]\.relative_path "
                                              r"is '\.\./.*'.*inside the directory"):
        sharded.load(model(1), path)


@pytest.mark.parametrize("held", ["every file", "none"])
def test_a_load_reads_one_checkpoint_whole_while_a_save_replaces_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: str) -> None:
    """A save swaps B in after the load has looked at A and before it reads the shards. A load
    holding A's files open returns A whole; one that could hold none (a low open-file limit)
    finds A's files gone, starts again and returns B whole. The next load returns B."""
    path = tmp_path / "ckpt"
    plain = _saved_plain(path)
    first = {k: v.clone() for k, v in plain.state_dict().items()}
    other = model(1)
    train_step(other, adam(other), 0)
    dcp_load = sharded.dcp_load  # type: ignore[attr-defined]
    saves: list[int] = []

    def save_meanwhile(*args: Any, **kwargs: Any) -> Any:
        if not saves:
            saves.append(1)
            sharded.save(other, path)
        return dcp_load(*args, **kwargs)

    monkeypatch.setattr(sharded, "dcp_load", save_meanwhile)
    if held == "none":
        monkeypatch.setattr(opened, "_budget", lambda: 0)
    target = model(9)
    sharded.load(target, path)
    assert saves
    expected = first if held == "every file" else dict(other.state_dict())
    assert_same(dict(target.state_dict()), expected, f"one checkpoint, holding {held}")
    monkeypatch.undo()
    sharded.load(target, path)
    assert_same(dict(target.state_dict()), dict(other.state_dict()), "the new checkpoint")


def test_a_load_whose_checkpoint_is_swapped_away_and_removed_as_it_opens_reads_the_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save swaps B in and removes A while the load has A's directory open, after it read
    A's `.metadata` and before it looked at A's `.complete`: both are gone. The load starts
    again and returns B whole (it said "there is no DCP checkpoint there" beside a save in a
    loop on a loaded machine)."""
    path = tmp_path / "ckpt"
    _saved_plain(path)
    other = model(1)
    train_step(other, adam(other), 0)
    read_marker = staging.read_marker
    saves: list[int] = []

    def save_meanwhile(directory: Any, dir_fd: int | None = None) -> str | None:
        if dir_fd is not None and not saves:
            saves.append(1)
            sharded.save(other, path)  # A's files, its marker among them, removed
        return read_marker(directory, dir_fd=dir_fd)

    monkeypatch.setattr(staging, "read_marker", save_meanwhile)
    target = model(9)
    sharded.load(target, path)
    assert saves
    assert_same(dict(target.state_dict()), dict(other.state_dict()), "the new checkpoint")


def _one_file_per_entry(path: Path) -> int:
    """Rewrite checkpoint `path` so that each of its entries lies in a shard file of its own
    (as a save by that many ranks would); the number of files."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    shards = {p.name: p.read_bytes() for p in path.glob("*.distcp")}
    for p in path.glob("*.distcp"):
        p.unlink()
    for i, info in enumerate(metadata.storage_data.values()):
        data = shards[info.relative_path][info.offset:info.offset + info.length]
        info.relative_path, info.offset = f"__{i}_0.distcp", 0
        (path / info.relative_path).write_bytes(data)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return len(metadata.storage_data)


def test_a_checkpoint_of_more_files_than_the_open_file_limit_loads(tmp_path: Path) -> None:
    """A load opened every shard file at once: 601 files under a soft limit of 512 was
    'damaged (a copy or a save cut short?)'; DCP's own reader loads it."""
    path = tmp_path / "ckpt"
    wide = nn.Sequential(*[nn.Linear(1, 1) for _ in range(300)])
    sharded.save(wide, path)
    assert _one_file_per_entry(path) == 601  # 300 weights, 300 biases, the layout record
    target = nn.Sequential(*[nn.Linear(1, 1) for _ in range(300)])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        sharded.load(target, path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert_same(dict(target.state_dict()), dict(wide.state_dict()), "601 shard files")
