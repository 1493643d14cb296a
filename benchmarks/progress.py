"""A one-line progress bar on stderr (a line per update when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


class ProgressBar:
    """`advance(label)` after each unit of work; shows done/total, elapsed time and an ETA."""

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True,
                 width: int = 28) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.width = width
        self.start = time.monotonic()
        self.tty = self.stream.isatty()

    def render(self, label: str) -> str:
        filled = int(self.width * self.done / self.total)
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{_clock(elapsed)} elapsed, ~{_clock(eta)} left  {label}")

    def advance(self, label: str, units: int = 1) -> None:
        self.done = min(self.total, self.done + units)
        if not self.enabled:
            return
        line = self.render(label)
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A message on its own line, keeping the bar below it."""
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()
