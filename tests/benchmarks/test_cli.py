"""`python -m benchmarks`: arguments, outputs, and the quick suite end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.cli import main, write_outputs
from benchmarks.records import build_records, validate_record
from tests.benchmarks import fakes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    ["--models", "resnet"], ["--transport", "pigeon"], ["--ranks", "0"],
    ["--models", "tiny", "--ranks", "9"],  # 5 layers cannot fill 9 stages: nothing to run
])
def test_bad_arguments_exit_2(argv: list[str], tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "python -m benchmarks:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--schedules", "1f1b,pipedream"], "unknown schedule 'pipedream'; known: gpipe"),
    (["--warmup", "-1"], "--warmup must be >= 0 (got -1)"),
])
def test_bad_values_are_refused_before_any_measurement(
        argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("benchmarks.cli.run_group", fakes.no_run)
    assert main([*argv, "--models", "tiny", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--ranks", "abc"], "--ranks takes comma-separated whole numbers >= 1, e.g. 1,2 (got 'abc')"),
    (["--ranks", "1,2.5"], "--ranks takes comma-separated whole numbers >= 1, e.g. 1,2 (got "
                           "'1,2.5': '2.5' is not one)"),
    (["--ranks", "0"], "--ranks takes comma-separated whole numbers >= 1, e.g. 1,2 (got '0')"),
    (["--microbatches", "4,x"], "--microbatches takes comma-separated whole numbers >= 1, e.g. "
                                "4,8,16 (got '4,x': 'x' is not one)"),
    (["--microbatches", "9" * 5000], "--microbatches takes comma-separated whole numbers"),
])
def test_count_lists_name_their_flag(argv: list[str], message: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`--ranks abc` once said only "invalid literal for int() with base 10: 'abc'"."""
    monkeypatch.setattr("benchmarks.cli.run_group", fakes.no_run)
    assert main([*argv, "--models", "tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_out_naming_a_file_is_refused_before_any_measurement(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("benchmarks.cli.run_group", fakes.no_run)
    taken = tmp_path / "results.txt"
    taken.write_text("keep me")
    assert main(["--models", "tiny", "--out", str(taken)]) == 2
    assert f"--out {taken} is a file" in capsys.readouterr().err
    assert taken.read_text() == "keep me"


def test_unknown_suite_is_an_argparse_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--suite", "huge", "--out", str(tmp_path)])
    assert exc.value.code == 2


def test_write_outputs(tmp_path: Path) -> None:
    g = fakes.group(2)
    built = build_records(g, {4: fakes.measured(g, 4)}, fakes.ENV)
    records = [r for r, _ in built]
    timelines = {r["id"]: tl for r, tl in built if tl is not None}
    write_outputs(tmp_path, records, timelines, fakes.ENV, suite="quick", command="cmd",
                  plots=False)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(records)
    for line in lines:
        record = json.loads(line)
        validate_record(record)
        assert (tmp_path / record["timeline"]).exists()
    assert "## Targets" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "environment.json").read_text()) == fakes.ENV
    assert not (tmp_path / "plots").exists()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_quick_suite_end_to_end(tmp_path: Path) -> None:
    """What CI runs: the quick suite on the tiny model gives valid JSON and markdown."""
    out = tmp_path / "bench"
    # A hang guard, not an expected duration: about a minute on an idle machine, but over three
    # on a loaded one (it starts a dozen processes and times real steps).
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--suite", "quick", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\b(\d+)/\1 \[", proc.stderr), proc.stderr[-500:]  # the bar got to the end
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for r in records:
        validate_record(r)
    seen = {(r["config"]["transport"], r["config"]["num_ranks"], r["config"]["schedule"])
            for r in records}
    assert ("threads", 2, "zb-h1") in seen and ("processes", 1, "1f1b") in seen
    report = (out / "report.md").read_text()
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        # One GPU: one process per rank cannot run at p = 2; the report says so.
        assert ("processes", 2, "1f1b") not in seen
        assert "## Not run here" in report and "needs 2 GPUs" in report
    else:
        assert ("processes", 2, "1f1b") in seen
    torch_ran = [r for r in records if r["config"]["transport"] == "processes"
                 and r["torch"]["step_time_s"] is not None]
    assert torch_ran and all(r["ratios"]["ours_over_torch"] > 0 for r in torch_ran)
    assert "## Targets" in report and "## `tiny`, balance by params" in report
    assert (out / "plots" / "best.svg").exists()
