"""`--suite lengths` on a short config: the three modes and torch's peer run on 2 processes,
torch's loss and gradients are ours on one batch, the table renders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import cli, lengths

pytestmark = pytest.mark.dist

SHORT = lengths.LengthsSuite(width=16, layers=2, heads=2, rows=4, chunks=2, max_length=24,
                             batches=2, warmup=0, repeats=1)


def test_speeches_have_natural_lengths() -> None:
    cut = lengths.speeches(256)
    sizes = sorted(len(s) for s in cut)
    assert len(cut) > 100 and sizes[0] < 20 and sizes[-1] == 256  # a long tail, capped
    assert sizes[len(sizes) // 2] < 128  # most speeches are short: padding dominates (a)


def test_a_short_run_measures_every_mode_and_torch_and_renders() -> None:
    result = lengths.run_suite(SHORT)
    assert set(result["tokens_per_s"]) == {*lengths.MODES, *lengths.PEER}
    assert result["counted"]["corpus"] == result["counted"]["tokens"]  # the same tokens
    assert result["counted"]["torch"] == result["counted"]["corpus"]
    assert result["padded"]["torch"] == result["padded"]["corpus"]  # the batches of (a)
    assert result["padded"]["tokens"] <= result["padded"]["batch"] <= result["padded"]["corpus"]
    # Torch's peer does our work: the same loss and gradients on one batch of (a).
    check = result["torch_check"]
    assert check["ours_loss"] == pytest.approx(check["torch_loss"], rel=1e-5)
    assert check["compared"] > 0 and check["max_grad_diff"] < 1e-5
    assert set(result["vs_torch"]) == set(lengths.MODES)
    table = lengths.render(result, "python -m benchmarks --suite lengths", "test")
    assert "(c) token micro-batches" in table and "Command:" in table
    assert "| torch.distributed.pipelining, padded as (a) |" in table
    assert "(c) vs torch:" in table and "(a) vs torch:" in table


def test_the_cli_writes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake: dict[str, Any] = {"seconds": dict.fromkeys(lengths.MODES, 1.0),
                            "counted": dict.fromkeys(lengths.MODES, 10),
                            "padded": {"corpus": 40, "batch": 20, "tokens": 12},
                            "longest": 24, "suite": SHORT.__dict__,
                            "tokens_per_s": {"corpus": 10.0, "batch": 12.0, "tokens": 16.0}}
    monkeypatch.setattr(lengths, "run_suite", lambda suite: fake)
    assert cli.main(["--suite", "lengths", "--out", str(tmp_path), "--repeats", "1"]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "1.60x" in report and "--suite lengths --out" in report
    assert "pipelining" not in report  # a result without the peer renders without its row


def test_the_torch_row_and_ratios_render() -> None:
    modes = [*lengths.MODES, *lengths.PEER]
    fake: dict[str, Any] = {"counted": dict.fromkeys(modes, 10),
                            "padded": {"corpus": 40, "batch": 20, "tokens": 12, "torch": 40},
                            "longest": 24, "suite": SHORT.__dict__,
                            "tokens_per_s": {"corpus": 10.0, "batch": 12.0, "tokens": 16.0,
                                             "torch": 8.0},
                            "torch_check": {"ours_loss": 5.5, "torch_loss": 5.5,
                                            "max_grad_diff": 0.0, "compared": 8}}
    table = lengths.render(fake, "python -m benchmarks --suite lengths", "test")
    assert "| torch.distributed.pipelining, padded as (a) | 8 | 75% | 0.80x |" in table
    assert "(c) vs torch: 2.00x; (a) vs torch: 1.25x" in table
