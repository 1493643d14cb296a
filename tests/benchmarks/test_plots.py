"""benchmarks.plots: the line chart, the choice of best and worst, the files written."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from benchmarks.plots import Series, best_and_worst, line_chart_svg, write_plots
from benchmarks.records import build_records
from schedules import Timeline
from tests.benchmarks import fakes

SVG = "{http://www.w3.org/2000/svg}"


def test_line_chart_is_svg_with_a_polyline_per_series() -> None:
    svg = line_chart_svg([Series("a", ((1, 2.0), (4, 3.0), (2, 1.0))),
                          Series("b <&>", ((1, 1.0),), "#ff0000", "4 2")],
                         title="t", x_label="m", y_label="ms")
    root = ET.fromstring(svg)
    lines = root.findall(f"{SVG}polyline")
    assert [p.get("data-label") for p in lines] == ["a", "b <&>"]
    xs = [float(pt.split(",")[0]) for pt in (lines[0].get("points") or "").split()]
    assert xs == sorted(xs) and xs[1] - xs[0] == pytest.approx(xs[2] - xs[1])  # log2 axis
    assert lines[1].get("stroke-dasharray") == "4 2"
    with pytest.raises(ValueError):
        line_chart_svg([], title="t", x_label="m", y_label="ms")


def _built() -> list[tuple[dict[str, Any], Timeline | None]]:
    g = fakes.group(2, microbatches=(2, 4, 8))
    return build_records(g, {m: fakes.measured(g, m) for m in g.microbatches}, fakes.ENV)


def test_best_and_worst_by_speedup_over_the_plain_model() -> None:
    records = [r for r, _ in _built()]
    best, worst = best_and_worst(records) or ({}, {})
    speedups = [r["ratios"]["speedup_vs_plain_1_thread"] for r in records]
    assert best["ratios"]["speedup_vs_plain_1_thread"] == max(speedups)
    assert worst["ratios"]["speedup_vs_plain_1_thread"] == min(speedups)
    assert best_and_worst([]) is None


def test_write_plots(tmp_path: Path) -> None:
    built = _built()
    records = [r for r, _ in built]
    timelines = {r["id"]: tl for r, tl in built if tl is not None}
    written = write_plots(tmp_path, records, timelines)
    names = {p.name for p in written}
    assert {"best.svg", "worst.svg", "step_time_vs_m_tiny_params_processes_p2.svg",
            "timelines_vs_m_tiny_params_processes_p2.svg"} <= names
    for p in written:
        assert p.exists()
        if p.suffix == ".svg":
            ET.fromstring(p.read_text())
    chart = ET.fromstring((tmp_path / "step_time_vs_m_tiny_params_processes_p2.svg").read_text())
    labels = {p.get("data-label") for p in chart.findall(f"{SVG}polyline")}
    assert {"ours 1f1b", "torch 1f1b", "plain, 1 thread", "hardware bound"} <= labels
