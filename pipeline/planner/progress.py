"""How far planning has got: the phases (profiling, contention, search) and their steps done."""

from __future__ import annotations

from typing import Protocol

__all__ = ["SILENT", "Progress"]


class Progress(Protocol):
    """What `plan()` reports while it works: `phase(name, total)` when a phase of `total`
    steps starts, `advance(n)` as steps of it end. A command line draws a bar with it."""

    def phase(self, name: str, total: int) -> None: ...

    def advance(self, n: int = 1) -> None: ...


class _Silent:
    """Reports nothing: the default, so the library prints nothing of its own."""

    def phase(self, name: str, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


SILENT: Progress = _Silent()
