"""benchmarks.tracing: a split model against the same layers flattened by hand (runs; no
speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tracing import main

pytest.importorskip("transformers")


def test_the_benchmark_runs_and_both_pipes_compute_the_same_loss(tmp_path: Path) -> None:
    assert main(["--layers", "4", "--hidden", "32", "--vocab", "64", "--seq", "8", "--rows",
                 "4", "--chunks", "2", "--stages", "2", "--rounds", "1", "--steps", "1",
                 "--splits", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())["records"][0]
    assert record["stages"] == 2 and record["split_points"] == ["model.layers.2"]
    # The same weights, the same ops (an explicit causal mask or is_causal): the same loss.
    assert record["loss_traced"] == pytest.approx(record["loss_eager"], rel=1e-6)
    assert record["loss_traced"] == pytest.approx(record["loss_causal"], rel=1e-6)
    assert record["trace_first_s"] > 0 and record["ratio_median"] > 0
    assert "| 2 |" in (tmp_path / "report.md").read_text()
