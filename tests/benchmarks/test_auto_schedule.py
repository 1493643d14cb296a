"""benchmarks/auto_schedule.py: the simulated table of auto on unequal stages."""

from __future__ import annotations

import pytest

from benchmarks.auto_schedule import balanced, main, simulated, stage_costs


def test_the_head_stage_gets_fewer_blocks_and_auto_is_never_slower() -> None:
    blocks = balanced(4, 16, head=4.0, head_w=2.0)
    assert blocks == [4, 6, 6, 0]  # the head alone outweighs six blocks' F + I + W
    costs = stage_costs(blocks, head=4.0, head_w=2.0, comm=0.25)
    row = simulated(4, 4, costs)
    assert row["auto"] == pytest.approx(0.968 * row["fixed_makespan"], abs=0.01 * row["auto"])
    assert row["fixed_makespan"] >= row["auto"] >= row["ideal"]


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ranks", "2", "--microbatches", "4", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("| p | blocks | m | auto |")
    assert [line.split(" | ")[2] for line in lines[3:]] == ["4", "8"]
