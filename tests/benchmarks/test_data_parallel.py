"""`python -m benchmarks --suite dp`: pipeline x data parallelism against DDP."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.cli import main
from benchmarks.data_parallel import CONFIGS, DpSuite, _hidden, run_suite
from benchmarks.report import data_parallel_table
from tests.benchmarks import fakes


def test_the_hidden_share_pools_the_ranks_of_each_step() -> None:
    step = [{"allreduce_s": 0.004, "exposed_s": 0.001, "hidden_share": 0.75, "buckets": 1.0},
            {"allreduce_s": 0.002, "exposed_s": 0.001, "hidden_share": 0.5, "buckets": 2.0}]
    done = _hidden([[step[0], step[0]], [step[1], step[1]]])  # two ranks, two steps each
    assert done["hidden_share"]["median"] == pytest.approx(1 - 0.002 / 0.006)
    assert done["hidden_share_per_rank"] == [0.75, 0.5]
    assert done["allreduce_s"]["median"] == 0.004 and done["buckets"] == [1, 2]


def test_too_few_gpus_list_every_configuration_as_skipped() -> None:
    records, notes = run_suite(DpSuite(model="tiny", device="cuda"), fakes.ENV, num_gpus=1)
    assert [r["config"]["name"] for r in records] == [c.name for c in CONFIGS]
    assert all(r["skipped"] == notes[0] and r["step_time_s"] is None for r in records)
    assert "needs 4 GPUs and 1 is here" in notes[0]
    table = data_parallel_table(records)
    assert table.count("| skipped: ") == 3


@pytest.mark.parametrize(("argv", "message"), [
    (["--ranks", "2"], "--ranks does not apply to --suite dp"),
    (["--microbatches", "4,8"], "--microbatches takes one value with --suite dp"),
    (["--models", "resnet"], "unknown model 'resnet'"),
])
def test_flags_the_dp_suite_cannot_take_are_refused(
        argv: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--suite", "dp", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.dist
def test_dp_suite_end_to_end(tmp_path: Path) -> None:
    """Four processes, the tiny model, two timed steps: the report has the three rows, and
    the 2x2 row the hidden share of its gradient all-reduce."""
    out = tmp_path / "dp"
    assert main(["--suite", "dp", "--models", "tiny", "--warmup", "1", "--repeats", "2",
                 "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["config"]["name"] for r in records] == ["2x2", "1x4", "4x1"]
    for r in records:
        assert r["skipped"] is None and r["step_time_s"]["n"] == 2
        assert len(r["peak_stashed_bytes"]) == len(r["param_bytes"]) == 4
    hidden = records[0]["data_parallel"]["hidden_share"]
    assert 0.0 <= hidden["min"] <= hidden["median"] <= hidden["max"] <= 1.0
    assert records[1]["data_parallel"] is None and records[2]["data_parallel"] is None
    report = (out / "report.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (2x2|1x4|4x1) \|.*$", report,
                                                        re.MULTILINE)}
    assert sorted(rows) == ["1x4", "2x2", "4x1"]
    assert re.search(r"\| \d+% \(all-reduce [\d.]+ ms, exposed [\d.]+ ms\) \|$", rows["2x2"])
