"""Benchmark harness: schedules, peers and the cost model, measured side by side."""
