"""How ranks of a pipeline tell each other of a failure: errors, reports in the store, poison."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from pipeline.comm import quiet_exit
from pipeline.errors import PipelineError

__all__ = [
    "PeerFailure",
    "PeerTimeout",
    "PipelineAborted",
    "Watch",
    "default_store",
    "first_report",
    "guarded",
    "poison_flag",
    "poisoned_rank",
    "report",
]

# A failing rank r takes a ticket from _FAILURES and writes "ticket\nnote" under
# _FAILED + its global rank: a key only it writes, so a report names its writer, and the
# lowest ticket is the first failure. Anything else in the store is ignored.
_FAILURES = "pipeline/failures"
_FAILED = "pipeline/failed/"
_P = ParamSpec("_P")
_R = TypeVar("_R")


class PipelineAborted(RuntimeError):
    """Raised in a worker when another rank has failed; carries the failed rank."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class PeerTimeout(TimeoutError):
    """A wait for a peer's message gave up: names the peer (`src`) and what was awaited."""

    def __init__(self, rank: int | None, src: int, what: str, seconds: float) -> None:
        waiter = "" if rank is None else f"rank {rank} "
        super().__init__(f"{waiter}waited {seconds:g}s for {what} from rank {src}; raise "
                         f"Pipe(timeout=...) if a stage is really that slow")
        self.src, self.what, self.seconds = src, what, seconds


class PeerFailure(RuntimeError):
    """A peer rank died or its connection broke."""


def poison_flag(rank: int) -> int:
    """The flag a failing `rank` writes where a peer expects its next message: wakes a receive
    blocked on it."""
    return -1 - rank


def poisoned_rank(flag: int, world_size: int) -> int | None:
    """The failed rank a message flag names, or None when it is not a poison of this group."""
    return -flag - 1 if flag < 0 and -flag - 1 < world_size else None


def report(store: Any, global_rank: int, note: str) -> None:
    """Write this rank's failure report (best effort: if the store is gone, peers still see a
    broken connection or time out)."""
    with contextlib.suppress(Exception):
        ticket = store.add(_FAILURES, 1)
        store.set(f"{_FAILED}{global_rank}", f"{ticket}\n{note}")


def first_report(store: Any, watch: list[int]) -> tuple[int, str] | None:
    """(rank, note) of the first failure reported by a rank of `watch` (global ranks; the
    rank returned is its index there), or None. Raises what the store raises."""
    if not store.check([_FAILURES]):
        return None
    reports = []
    for rank, global_rank in enumerate(watch):
        key = f"{_FAILED}{global_rank}"
        if store.check([key]):
            parsed = _parse_report(store.get(key), rank)
            if parsed is not None:
                reports.append(parsed)
    if not reports:
        return None
    _, rank, note = min(reports)
    return rank, note


def _parse_report(raw: bytes, rank: int) -> tuple[int, int, str] | None:
    """(ticket, rank, note) from what `report` wrote, or None for anything else."""
    try:
        ticket, sep, note = raw.decode("utf-8").partition("\n")
        if not sep or not ticket.isdigit() or len(ticket) > 18:
            return None
        return int(ticket), rank, note
    except UnicodeDecodeError:
        return None


class Watch:
    """The failure reports one rank listens to while it waits: `check` reads the store now,
    `tick(now)` at most every `every` seconds (waits call it between polls)."""

    def __init__(self, store: Any, watch: list[int], rank: int, every: float = 0.05) -> None:
        self.store, self.watch, self.rank, self.every = store, watch, rank, every
        self._last = 0.0

    def tick(self, now: float) -> None:
        if now - self._last > self.every:
            self._last = now
            self.check()

    def check(self) -> None:
        """Raise PipelineAborted with the first failure any watched rank reported."""
        if self.store is None:
            return
        try:
            first = first_report(self.store, self.watch)
        except Exception as exc:  # outside launchers that host it, rank 0 hosts the store
            raise PeerFailure(f"rank {self.rank} lost the rendezvous store (rank 0 hosts it "
                              f"unless a launcher does; did rank 0 exit?): {exc}") from exc
        if first is not None:
            raise PipelineAborted(*first)


def guarded(method: Callable[Concatenate[Any, _P], _R]) -> Callable[Concatenate[Any, _P], _R]:
    """A transport call that refuses to run once the transport has failed (its `_broken`
    holds the first failure; `unusable()` makes the error), and that remembers the first
    failure it raises. After one, messages of the failed step may still be in flight: read
    next, they would pass for the tie sync's or the next step's."""

    def run(self: Any, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self._broken is not None:
            raise self.unusable()
        try:
            return method(self, *args, **kwargs)
        except (PipelineAborted, PeerFailure, TimeoutError, PipelineError) as exc:
            if self._broken is None:
                self._broken = str(exc)
                quiet_exit.arm()  # the group is broken: its teardown may abort the process
            raise

    functools.update_wrapper(run, method)
    return run


def default_store() -> Any:
    """The default process group's store, or None."""
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: without it, failures surface by timeout
        return None
