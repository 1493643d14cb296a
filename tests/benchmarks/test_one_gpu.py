"""`--suite gpu` on the CPU at a toy size: every variant (the plain model, ours on 1, 2 and 4
stages and interleaved, torch's 1F1B and interleaved on a world of one) runs and is timed in
turn, the report renders, and the process group it made is gone afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks import cli, one_gpu

TOY = (one_gpu.GpuSize("toy", 4, 4, 8, "float32"),)
VARIANTS = {"plain", "ours p=1", "ours p=2", "ours p=4", "ours interleaved", "torch 1f1b",
            "torch interleaved"}


def test_every_variant_is_timed_side_by_side_and_rendered() -> None:
    result = one_gpu.run_suite(torch.device("cpu"), sizes=TOY, microbatches=(2, 4), warmup=1,
                               repeats=2)
    assert not dist.is_initialized()  # the world of one is closed with the suite
    assert [row["microbatches"] for row in result["rows"]] == [2, 4]
    for row in result["rows"]:
        assert set(row["seconds"]) == VARIANTS
        assert all(len(times) == 2 and min(times) > 0 for times in row["seconds"].values())
    table = one_gpu.render(result, "python -m benchmarks --suite gpu", "test")
    assert "| toy (4 x 4, 8 rows, float32) | 4 |" in table and "## To reproduce" in table


def test_the_command_writes_its_report_and_results(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(one_gpu.SIZES, "cpu", TOY)
    assert cli.main(["--suite", "gpu", "--device", "cpu", "--warmup", "0", "--repeats", "1",
                     "--microbatches", "2", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["device"] == "cpu" and len(saved["rows"]) == 1
    assert "p=1 / torch" in (tmp_path / "report.md").read_text()
