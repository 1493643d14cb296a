"""Contention (pipeline/planner/contention.py) in the benchmarks: a measurement that did not
get its CPUs is flagged, one that did is not; the records, report and environment.json carry
the figures."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import load_summary, main, write_outputs
from benchmarks.config import Group
from benchmarks.records import build_records, validate_record
from benchmarks.report import render_markdown
from pipeline.planner import contention
from pipeline.planner.contention import MARK, Meter, Reading
from tests.benchmarks import fakes


def _fake_machine(monkeypatch: pytest.MonkeyPatch, *, wall: list[float], cpu: list[float],
                  load: list[float], cores: int = 2) -> None:
    """The clocks `Meter` reads, each returning the next of its values."""
    clocks: dict[str, Iterator[float]] = {"wall": iter(wall), "cpu": iter(cpu),
                                          "load": iter(load)}
    monkeypatch.setattr(contention, "wall_clock", lambda: next(clocks["wall"]))
    monkeypatch.setattr(contention, "cpu_seconds",
                        lambda *, children=False: next(clocks["cpu"]))
    monkeypatch.setattr(contention, "load_average", lambda: next(clocks["load"]))
    monkeypatch.setattr(contention, "cores", lambda: cores)


def test_a_step_that_got_its_cpus_is_not_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 threads, 1 s of wall time, 1.9 s of CPU: they ran; the load stayed below 2 cores.
    _fake_machine(monkeypatch, wall=[10.0, 11.0], cpu=[5.0, 6.9], load=[1.2, 1.8])
    with Meter(2) as meter:
        pass
    reading = meter.reading
    assert reading == Reading(1.0, pytest.approx(1.9), 2, 2, 1.2, 1.8)
    assert reading.cpu_share == pytest.approx(0.95)
    assert not reading.contended() and reading.reasons() == []
    assert reading.to_dict()["contended"] is False


def test_a_step_that_waited_for_its_cpus_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 threads, 1 s of wall time, 0.6 s of CPU: most of the time they waited.
    _fake_machine(monkeypatch, wall=[10.0, 11.0], cpu=[5.0, 5.6], load=[1.0, 1.5])
    with Meter(2) as meter:
        pass
    assert meter.reading is not None
    assert meter.reading.cpu_share == pytest.approx(0.3)
    assert meter.reading.reasons() == [
        "it got 30.0% of the CPU time its 2 threads could use (under 50%)"]
    facts = meter.reading.to_dict()
    assert facts["contended"] is True and facts["cpu_s"] == pytest.approx(0.6)


def test_a_load_above_the_cores_flags_even_a_busy_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, wall=[0.0, 1.0], cpu=[0.0, 1.0], load=[1.0, 11.5])
    with Meter(1) as meter:
        pass
    assert meter.reading is not None
    assert meter.reading.reasons() == ["the load average was 11.5 on 2 cores"]


def test_a_pipeline_is_judged_outside_its_bubble() -> None:
    # Two ranks busy two thirds of the step (1f1b, p=2, m=2) with 1.2 s of CPU in 1 s.
    reading = Reading(1.0, 1.2, 2, 16, busy=2 / 3)
    assert reading.cpu_share == pytest.approx(0.9) and not reading.contended()
    assert Reading(1.0, 1.2, 2, 16).cpu_share == pytest.approx(0.6)


def test_rounds_add_up_and_keep_the_highest_load() -> None:
    total = Reading.total([Reading(1.0, 0.5, 2, 2, 0.5, 0.7), Reading(2.0, 2.0, 2, 2, 3.0, 1.0)])
    assert total == Reading(3.0, 2.5, 2, 2, 3.0, 1.0)
    assert Reading.total([]) is None


def _records(g: Group, **measured: Any) -> list[dict[str, Any]]:
    return [r for r, _ in build_records(g, {4: fakes.measured(g, 4, **measured)}, fakes.ENV)]


def test_records_and_the_report_mark_contended_figures() -> None:
    g = fakes.group(2, schedules=("1f1b",), transports=("processes",))
    calm = _records(g, cpu_share=1.0, load=(0.3, 0.4))
    busy = _records(g, cpu_share=0.2, load=(0.3, 0.4))
    for r in calm + busy:
        validate_record(r)
    cells = calm[0]["contention"]
    assert set(cells) == {"ours", "torch", "plain_1_thread", "plain_all_threads",
                          "hardware_bound"}
    assert all(c["contended"] is False for c in cells.values())
    assert cells["plain_all_threads"]["threads"] == 2 and cells["ours"]["busy"] < 1
    assert all(c["contended"] is True for c in busy[0]["contention"].values())
    calm_report = render_markdown(calm, fakes.ENV, suite="quick", command="cmd")
    busy_report = render_markdown(busy, fakes.ENV, suite="quick", command="cmd")
    assert "measured under contention" not in calm_report
    assert busy_report.count("measured under contention") >= 2  # results and baselines
    row = next(line for line in busy_report.splitlines() if line.startswith("| processes"))
    assert f" {MARK} |" in row  # beside the step time
    step_ms = row.split("|")[5]
    assert step_ms.strip().endswith(MARK)
    target = next(line for line in busy_report.splitlines()
                  if line.startswith("| ours / torch, 1f1b, p=2, m=4"))
    assert MARK in target
    # Only the load: figures from processes that had their CPUs on a loaded machine.
    loaded = _records(g, cpu_share=1.0, load=(5.0, 6.0))
    assert loaded[0]["contention"]["ours"]["reasons"] == [
        "the load average was 6.0 on 2 cores"]


def test_environment_json_carries_the_load(tmp_path: Path) -> None:
    g = fakes.group(2, schedules=("1f1b",), transports=("processes",))
    records = _records(g, cpu_share=0.2)
    env = {**fakes.ENV, "load": load_summary(Reading(30.0, 12.0, 2, 2, 3.5, 4.0), records)}
    write_outputs(tmp_path, records, {}, env, suite="quick", command="cmd", plots=False)
    load = json.loads((tmp_path / "environment.json").read_text())["load"]
    assert load["load_before"] == 3.5 and load["load_after"] == 4.0
    assert load["cpu_s"] == 12.0 and load["wall_s"] == 30.0
    assert load["cpu_share_floor"] == contention.CPU_SHARE_FLOOR
    assert load["contended_cells"] == [r["id"] for r in records]
    report = (tmp_path / "report.md").read_text()
    assert "load average 3.5 before the run, 4.0 after" in report
    assert f"1 configuration(s) measured under contention**, their figures marked {MARK}" \
        in report


def test_the_progress_bar_prints_its_last_line_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar reached 100 % on the last unit's update and close() drew it again: in a log
    (no terminal), two '100%' lines."""
    def fake_spawn(fn: object, n: int, group: Group, gate: object, progress: Any,
                   timeout: float) -> list[dict[int, Any]]:
        for m in group.microbatches:
            time.sleep(0.15)  # past tqdm's interval between draws: each update draws
            progress.put(m)
        time.sleep(0.15)
        return [{m: fakes.measured(group, m, cpu_share=1.0) for m in group.microbatches}]

    monkeypatch.setattr("benchmarks.cli.spawn", fake_spawn)
    monkeypatch.setattr(contention, "load_average", lambda: 0.5)
    out = tmp_path / "bench"
    assert main(["--models", "tiny", "--ranks", "2", "--microbatches", "2,4", "--schedules",
                 "1f1b", "--transport", "processes", "--no-plots", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    drawn = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert sum("100%" in line for line in drawn) == 1, drawn
    assert drawn[-1].startswith("100%") and "2/2" in drawn[-1]
    env = json.loads((out / "environment.json").read_text())
    assert env["load"]["load_before"] == 0.5 and env["load"]["contended_cells"] == []
    assert env["load"]["cpu_s"] is not None and env["load"]["wall_s"] > 0.3
