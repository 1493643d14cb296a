"""Benchmark harness: schedules, peers and the cost model, measured side by side."""

from __future__ import annotations

import logging

__all__: list[str] = []

# A library logs but never configures logging: silent unless the application (or
# `python -m benchmarks --verbose`) adds a handler.
logging.getLogger(__name__).addHandler(logging.NullHandler())
