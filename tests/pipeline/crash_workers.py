"""Spawned ranks for tests/pipeline/state/test_sharded_crash.py: save checkpoint A, then die
part-way through saving checkpoint B at a chosen point (a test-only patch inside the rank
process)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from pipeline import Pipe
from pipeline.state import sharded
from pipeline.state.held_writer import HeldFileSystem
from tests.pipeline.sharded_workers import adam, model, pack, snapshot, train_step

__all__ = ["POINTS", "save_and_die", "save_twice"]

# Where a rank dies while saving B: (the rank, the point). The points are in torch's
# FileSystemWriter and the held directory's filesystem it writes through, or counted renames
# (DCP renames `.metadata.tmp` into place on rank 0; a swap renames directories after it).
POINTS: dict[str, tuple[int, str]] = {
    "rank 1 before writing its shard": (1, "write:before"),
    "rank 1 with its shard half on disk": (1, "write:torn"),
    "rank 0 after writing its shard": (0, "write:after"),
    "rank 1 after its DCP save returned": (1, "save:after"),
    "rank 0 after renaming the metadata into place": (0, "rename:1"),
    "rank 0 after the second rename": (0, "rename:2"),
    "rank 0 after the third rename": (0, "rename:3"),
}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(where: str) -> None:
    """Patch this process so that it kills itself (SIGKILL, no clean-up) at `where`."""
    kind, _, arg = where.partition(":")
    if kind == "write" and arg in ("before", "after"):
        write_data = FileSystemWriter.write_data

        def patched_write(self: Any, *args: Any, **kwargs: Any) -> Any:
            if arg == "before":
                _die()
            result = write_data(self, *args, **kwargs)  # writes before it returns
            _die()
            return result

        FileSystemWriter.write_data = patched_write  # type: ignore[method-assign]
    elif kind == "write":  # torn: the shard written, then cut to half before the rank dies
        create_stream = HeldFileSystem.create_stream

        @contextlib.contextmanager
        def torn(self: Any, path: Any, mode: str) -> Iterator[Any]:
            with create_stream(self, path, mode) as stream:
                yield stream
                if "w" in mode and str(path).endswith(".distcp"):
                    fd = os.open(path, os.O_WRONLY, dir_fd=self.directory)
                    os.ftruncate(fd, os.fstat(fd).st_size // 2)
                    _die()

        HeldFileSystem.create_stream = torn  # type: ignore[method-assign]
    elif kind == "save":
        dcp_save = sharded.dcp_save  # type: ignore[attr-defined]

        def patched_save(*args: Any, **kwargs: Any) -> Any:
            result = dcp_save(*args, **kwargs)
            _die()
            return result

        sharded.dcp_save = patched_save  # type: ignore[attr-defined]
    elif kind == "before":  # before the arg-th rename (after `.complete`, for the swap's first)
        os.rename = _counting(os.rename, int(arg), before=True)
    else:
        os.rename = _counting(os.rename, int(arg))


def _counting(rename: Callable[..., None], limit: int, *, before: bool = False
              ) -> Callable[..., None]:
    count = 0

    def patched(*args: Any, **kwargs: Any) -> None:
        nonlocal count
        count += 1
        if before and count == limit:
            _die()
        rename(*args, **kwargs)
        if count == limit:
            _die()

    return patched


def save_twice(rank: int, path: str, snaps: str, point: str) -> None:
    """Save A (after one step), write this rank's snapshot of A and of B (one step later) to
    `snaps`, then save B with the crash point armed on its rank."""
    pipe = Pipe(model(0), [2, 4])
    optimizer = adam(pipe)
    train_step(pipe, optimizer, 0)
    sharded.save(pipe, path, optimizer)
    Path(snaps, f"A-{rank}.pt").write_bytes(pack(snapshot(pipe, optimizer)))
    train_step(pipe, optimizer, 1)
    Path(snaps, f"B-{rank}.pt").write_bytes(pack(snapshot(pipe, optimizer)))
    victim, where = POINTS[point]
    if rank == victim:
        _arm(where)
    sharded.save(pipe, path, optimizer)


def save_and_die(rank: int, path: str, snaps: str, steps: int, where: str, skew_ns: int) -> None:
    """Train `steps` steps, write this rank's snapshot to `snaps/<steps>-<rank>.pt`, then save
    with rank 0 dying at `where` (see `_arm`) and this process's clock `skew_ns` ahead."""
    pipe = Pipe(model(0), [2, 4])
    optimizer = adam(pipe)
    for step in range(steps):
        train_step(pipe, optimizer, step)
    Path(snaps, f"{steps}-{rank}.pt").write_bytes(pack(snapshot(pipe, optimizer)))
    if skew_ns:
        time_ns = time.time_ns
        time.time_ns = lambda: time_ns() + skew_ns
    if rank == 0:
        _arm(where)
    sharded.save(pipe, path, optimizer)
