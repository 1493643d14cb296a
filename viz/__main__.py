"""`python -m viz`: the pipeviz command line."""

from __future__ import annotations

from viz.cli import main

__all__: list[str] = []

raise SystemExit(main())
