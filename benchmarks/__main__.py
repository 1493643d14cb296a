"""Entry point of `python -m benchmarks` (see benchmarks/README.md)."""

from __future__ import annotations

from benchmarks.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
