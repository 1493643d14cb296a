"""A rank killed part-way through a sharded save leaves the previous checkpoint or the new one,
complete and bit-identical: never a mix, never a load error."""

from __future__ import annotations

import contextlib
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.launch import RankFailed, spawn
from pipeline.state import sharded
from tests.limits import DIST_TEST_TIMEOUT, SPAWN_TIMEOUT
from tests.pipeline.crash_workers import POINTS, save_and_die, save_twice
from tests.pipeline.sharded_workers import (
    adam,
    assert_same,
    load_continue,
    model,
    snapshot,
    train_step,
    unpack,
)

# What the checkpoint must hold after each crash: A (the save had not been agreed by every rank)
# or B (it had, and the swap had begun or finished).
_EXPECTED = {
    "rank 1 before writing its shard": "A",
    "rank 1 with its shard half on disk": "A",
    "rank 0 after writing its shard": "A",
    "rank 1 after its DCP save returned": "A",
    "rank 0 after renaming the metadata into place": "A",
    "rank 0 after the second rename": "B",
    "rank 0 after the third rename": "B",
}


def _snapshots(snaps: Path, which: str) -> dict[str, Any]:
    return unpack([(snaps / f"{which}-{rank}.pt").read_bytes() for rank in (0, 1)])


def _load_plain(path: Path) -> dict[str, Any]:
    """A fresh model (other weights, another lr) loaded from `path` in this process."""
    target = model(7)
    optimizer = adam(target, lr=0.5)
    sharded.load(target, path, optimizer)
    return snapshot(target, optimizer)


def _equal(a: Any, b: Any) -> bool:
    return bool(torch.equal(a, b)) if torch.is_tensor(a) else bool(a == b)


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != "snaps")


@pytest.mark.dist
@pytest.mark.timeout(2 * DIST_TEST_TIMEOUT)  # two spawns where `ckpt` is left missing
@pytest.mark.parametrize("point", list(POINTS))
def test_a_rank_killed_while_saving_leaves_one_complete_checkpoint(tmp_path: Path,
                                                                  point: str) -> None:
    path, snaps = tmp_path / "ckpt", tmp_path / "snaps"
    snaps.mkdir()
    with pytest.raises(RankFailed) as failed:
        spawn(save_twice, 2, str(path), str(snaps), point, timeout=SPAWN_TIMEOUT, grace=5.0)
    victim = POINTS[point][0]
    assert f"rank {victim}: process died (exit code -9)" in str(failed.value), failed.value
    expected = _snapshots(snaps, _EXPECTED[point])
    other = _snapshots(snaps, "B" if _EXPECTED[point] == "A" else "A")
    assert any(not _equal(expected[k], other[k]) for k in expected)  # A and B differ
    between = point == "rank 0 after the second rename"  # `ckpt` missing: the staged one loads
    with (pytest.warns(UserWarning, match="cut short between its two renames") if between
          else contextlib.nullcontext()):
        loaded = _load_plain(path)
    assert_same(loaded, expected, f"loaded after a crash of {point}")
    if between:  # every rank of a fresh process group finds the same staged checkpoint
        assert not path.exists()
        results = spawn(load_continue, 2, str(path), [3, 3], False, timeout=SPAWN_TIMEOUT)
        assert_same(unpack([r[1] for r in results]), expected, "2 processes")
    # The next save succeeds, replaces what was left and clears the crashed save's leftovers.
    plain = model(11)
    optimizer = adam(plain)
    sharded.save(plain, path, optimizer)
    assert _siblings(path) == ["ckpt"], _siblings(path)
    assert_same(_load_plain(path), snapshot(plain, optimizer), "saved after the crash")


@pytest.mark.dist
@pytest.mark.timeout(3 * DIST_TEST_TIMEOUT)  # two spawns and loads
def test_a_save_killed_before_its_swap_never_wins_whatever_its_clock(tmp_path: Path) -> None:
    """Save S dies after `.complete` and before its first rename, its clock 10 minutes ahead;
    save T dies between its renames. T had replaced the checkpoint: T loads."""
    path, snaps = tmp_path / "ckpt", tmp_path / "snaps"
    snaps.mkdir()
    plain = model(0)
    sharded.save(plain, path, adam(plain))  # the checkpoint S and T replace
    ten_minutes = 600 * 10**9
    for steps, where, skew in ((1, "before:2", ten_minutes), (2, "rename:2", 0)):
        with pytest.raises(RankFailed, match=r"rank 0: process died \(exit code -9\)"):
            spawn(save_and_die, 2, str(path), str(snaps), steps, where, skew,
                  timeout=SPAWN_TIMEOUT, grace=5.0)
    assert not path.exists()
    expected = unpack([(snaps / f"2-{rank}.pt").read_bytes() for rank in (0, 1)])
    with pytest.warns(UserWarning, match="cut short between its two renames"):
        assert_same(_load_plain(path), expected, "T, the save that was mid-swap")


def _which(loaded: dict[str, Any], candidates: list[dict[str, Any]]) -> int | None:
    """The index of the candidate `loaded` equals, every key bitwise; None for a mix."""
    for i, candidate in enumerate(candidates):
        if sorted(candidate) == sorted(loaded) and all(_equal(loaded[k], v)
                                                       for k, v in candidate.items()):
            return i
    return None


@pytest.mark.timeout(300)
def test_loads_while_saves_replace_the_checkpoint_see_one_whole_checkpoint(
        tmp_path: Path) -> None:
    """One saver replaces the checkpoint again and again (two states in turn); every load
    meanwhile returns one of them whole, never a mix and never an error."""
    path = tmp_path / "ckpt"
    states = []
    for seed in (0, 1):
        plain = model(seed)
        optimizer = adam(plain)
        train_step(plain, optimizer, seed)
        states.append((plain, optimizer, snapshot(plain, optimizer)))
    sharded.save(states[0][0], path, states[0][1])
    stop, failures = threading.Event(), []

    def saver() -> None:
        try:
            for i in range(1, 400):
                if stop.is_set():
                    return
                sharded.save(states[i % 2][0], path, states[i % 2][1])
        except Exception as exc:  # reported by the test below
            failures.append(exc)

    thread = threading.Thread(target=saver)
    thread.start()
    seen = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a load between the renames warns: expected
            while len(seen) < 30 and thread.is_alive():
                seen.append(_which(_load_plain(path), [s[2] for s in states]))
    finally:
        stop.set()
        thread.join()
    assert not failures, failures
    assert len(seen) >= 5 and None not in seen, seen
