"""Benchmark harness: schedules, peers and the cost model, measured side by side."""

from __future__ import annotations

__all__: list[str] = []
