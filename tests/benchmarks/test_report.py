"""benchmarks.report: targets with their shortfall, and the markdown tables."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.records import build_records
from benchmarks.report import (
    Target,
    evaluate_targets,
    format_bytes,
    format_ms,
    render_markdown,
    results_table,
)
from tests.benchmarks import fakes


def _records(model: str = "tiny") -> list[dict]:  # type: ignore[type-arg]
    out = []
    for p in (1, 2):
        g = fakes.group(p, model=model, microbatches=(4, 8))
        measured = {m: fakes.measured(g, m) for m in g.microbatches}
        out += [r for r, _ in build_records(g, measured, fakes.ENV)]
    return out


def test_target_status_says_by_how_much() -> None:
    assert Target("t", 0.80, 0.85, True).status == "met"
    assert Target("t", 1.02, 0.85, True).status == "missed by 0.170 (20% of the goal)"
    assert Target("t", 0.90, 0.95, False, "%").status == "missed by 5.0 points (5% of the goal)"
    assert Target("t", None, 1.0, True).status == "not measured"
    assert Target("t", 0.96, 0.95, False, "%").row() == "| t | >= 95.0% | 96.0% | met |"


def test_evaluate_targets_on_the_reference_model() -> None:
    targets = {t.name: t for t in evaluate_targets(_records(), microbatches=(4, 8, 16))}
    t = targets["ours / torch, 1f1b, p=2, m=4"]
    assert t.value == pytest.approx(1 / fakes.TORCH_FACTOR, rel=0.1) and t.met
    assert targets["ours / torch, gpipe, p=2, m=16"].status == "not measured"
    cells = [targets[f"ours / torch, {s}, p=2, m={m}"].value for s in ("gpipe", "1f1b")
             for m in (4, 8)]
    median = targets["ours / torch, median of the gpipe and 1f1b cells above"]
    assert median.value == pytest.approx(statistics.median(cells))  # type: ignore[type-var]
    bound = {r["config"]["num_microbatches"]: r["ratios"]["efficiency_hardware_bound"]
             for r in _records() if r["config"]["schedule"] == "1f1b"
             and r["config"]["num_ranks"] == 2 and r["config"]["transport"] == "processes"}
    cap = targets["share of 1F1B's cap (hardware bound x (m + 1) / m), p=2, m=8"]
    assert cap.value == pytest.approx(bound[8] * 9 / 8)
    zb = targets["zb-h1 / 1f1b step time, p=2, m=8"]
    assert zb.value is not None and zb.value < 1 and zb.met  # zb-h1's unit-cost makespan wins
    assert targets["1-stage overhead (Pipe / plain, 1 thread), m=4"].value is not None
    sim = targets["simulator median |error|, all runs with p >= 2"]
    assert sim.value is not None and 0 < sim.value < 0.1


def test_no_records_no_targets() -> None:
    assert evaluate_targets([]) == []


def test_format_ms() -> None:
    s = {"median": 0.0123, "min": 0.0119, "max": 0.014, "n": 3}
    assert format_ms(s) == "12.3" and format_ms(s, spread=True) == "12.3 (11.9-14.0)"
    assert format_ms(None) == "-"


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(46080) == "45.0 KiB"
    assert format_bytes(25 * 2**20) == "25.0 MiB"
    assert format_bytes(3 * 2**40) == "3072.0 GiB"


def test_results_table_has_a_row_per_record() -> None:
    records = _records()
    table = results_table(records).splitlines()
    assert len(table) == 2 + len(records)
    assert table[0].startswith("| transport | p | schedule | m |")
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert table[2].startswith("| processes | 1 | 1f1b | 4 |")  # processes first, p, schedule


def test_render_markdown_sections() -> None:
    text = render_markdown(_records(), fakes.ENV, suite="quick", command="python -m benchmarks",
                           failures=["tiny/params/p2: rank 1 died"])
    for heading in ("# Benchmark results: suite `quick`", "## Environment", "## Targets",
                    "## Failures", "## `tiny`, balance by params", "Baselines:"):
        assert heading in text
    assert "rank 1 died" in text and "test cpu" in text
