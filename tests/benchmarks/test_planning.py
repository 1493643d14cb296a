"""benchmarks.planning: the planner against the default and against exhaustive measurement."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.planning import main, report


def _row(config: str, step: float, peak: float) -> dict[str, object]:
    return {"config": config, "predicted_step_s": step, "predicted_peak_bytes": [peak, peak],
            "measured_step_s": step * 1.1, "measured_samples": [step * 1.1],
            "measured_peak_bytes": [peak, peak * 0.9]}


def test_report_tables_plan_default_and_best() -> None:
    record = {"model": "mlp", "transport": "threads", "budget_bytes": 100 * 2**20,
              "planning_s": 0.02, "space": 37,
              "plan": _row("zb-h1 m=1 never [4, 5]", 0.08, 80 * 2**20),
              "default": _row("1f1b m=2 except_last [4, 5]", 0.16, 90 * 2**20),
              "best": _row("zb-h1 m=1 never [4, 5]", 0.08, 80 * 2**20),
              "plan_over_best": 1.0}
    text = report([record])
    assert "| mlp | threads | 100.0 MiB | plan | zb-h1 m=1 never [4, 5] | 80.0 ms | 88.0 ms |" \
        in text
    assert "| mlp | threads | 1.000 | yes | yes | 37 | 0.02 |" in text


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    assert main(["--models", "tiny", "--transports", "threads", "--chunks", "1,2",
                 "--screen-steps", "1", "--rounds", "1", "--final", "1",
                 "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| tiny | threads |" in text and (tmp_path / "results.json").exists()
