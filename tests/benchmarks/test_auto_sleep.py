"""benchmarks/auto_sleep.py: sleep-cost stages train exactly, their sleeps land in the actions
that name them, auto's profile sees them, and the measured mode runs (no speed asserted)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.auto_schedule import main, stage_costs
from benchmarks.auto_sleep import (
    REPLAY,
    SleepBlock,
    measure_cell,
    plan,
    row,
    rows_of,
    runtime_costs,
    sleep_model,
    summarise,
)
from pipeline import Pipe
from schedules import Op, Schedule, get_schedule

UNIT = 1e-3  # seconds a block unit: sleeps short enough for a test


def _reference_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor
                     ) -> list[torch.Tensor]:
    """The same blocks written as plain torch ops (no sleeping Function), one device."""
    weights = [block.weight.detach().clone().requires_grad_(True) for block in model]
    h = x
    for w in weights:
        h = torch.tanh(h * w)
    nn.MSELoss()(h, y).backward()
    return [w.grad for w in weights if w.grad is not None]


def test_split_backward_puts_each_sleep_in_its_action_and_the_gradients_are_exact() -> None:
    seen: list[tuple[str, str, Op]] = []
    pipe: Any = None
    stage_of: dict[str, int] = {}

    def log(label: str, kind: str) -> None:
        # The rank running this stage runs one action at a time, on this thread: its current
        # action is the one this sleep belongs to.
        runtime = next(rt for rt in pipe._executor.runtimes if stage_of[label] in rt.stages)
        seen.append((label, kind, runtime.current.op))

    torch.manual_seed(0)
    model, balance = sleep_model([2, 1], head=2.0, head_w=2.0, unit=UNIT, log=log)
    labels = [block.label for block in model]
    stage_of.update({label: 0 if n < balance[0] else 1 for n, label in enumerate(labels)})
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    expected = _reference_grads(model, x, y)
    pipe = Pipe(model, balance, devices=["cpu", "cpu"], chunks=4, schedule="zb-h1",
                checkpoint="never")
    try:
        pipe.step(x, y, nn.MSELoss())
    finally:
        pipe.close()
    for block, grad in zip(model, expected, strict=True):
        assert block.weight.grad is not None
        torch.testing.assert_close(block.weight.grad, grad)
    # Stage 1 splits: x's branch in I, w's in W. Stage 0's input needs no gradient, so its
    # I computes nothing and its W runs the whole backward (both branches).
    where = {(stage_of[label], kind, op) for label, kind, op in seen}
    assert where == {(0, "F", Op.F), (0, "I", Op.W), (0, "W", Op.W),
                     (1, "F", Op.F), (1, "I", Op.I), (1, "W", Op.W)}
    # Every sleep ran once per micro-batch: 4 forwards of every block, 4 backwards of each
    # branch that sleeps (the embedding's x branch does not).
    for label in labels:
        counts = {kind: sum(1 for s in seen if s[:2] == (label, kind)) for kind in "FIW"}
        assert counts == {"F": 4, "I": 0 if label == "embedding" else 4, "W": 4}


def test_a_negative_sleep_is_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match=r"sleeps must be >= 0 seconds \(got F 1, I -1"):
        SleepBlock(4, forward_s=1, input_s=-1, weight_s=0)
    with pytest.raises(ValueError, match="unit > 0 seconds"):
        sleep_model([1, 1], head=1.0, head_w=1.0, unit=0.0)


def test_the_measured_cell_runs_and_autos_profile_sees_the_sleeps() -> None:
    blocks = [2, 1]
    r = measure_cell(blocks, 2, head=2.0, head_w=2.0, unit=UNIT, steps=2)
    # m = p: every fixed schedule holds at most p micro-batches (gpipe and zb-h2 too).
    assert set(r["median_s"]) == {"auto", REPLAY, "gpipe", "1f1b", "zb-h1", "zb-h2",
                                  "zb-h1-tight"}
    assert r["best_fixed"] in r["median_s"] and r["sim_auto"] <= r["sim_fixed"]
    # A sleep lasts at least its time: what auto measured per stage is never below it.
    nominal = runtime_costs(stage_costs(blocks, head=2.0, head_w=2.0, comm=0.25), 2)
    assert nominal.of(Op.I, 0) == 0 and nominal.of(Op.W, 0) == 2 + 2.5  # stage 0's I in W
    for op in (Op.F, Op.I, Op.W):
        for s in range(2):
            got, slept = r["measured_costs"].of(op, s), nominal.of(op, s) * UNIT
            assert got >= slept, (op, s, got, slept)
    assert r["profile"] >= 1.0
    assert set(r["queued_s"]) == set(r["median_s"]) == set(r["sim_makespans"])
    # The table's measured / simulated column: each fixed schedule's own makespan, and auto's
    # (and its replay's) that of the order it ran, simulated for the sleeps.
    assert r["sim_makespans"][r["sim_best_fixed"]] == r["sim_fixed"]
    if r["same_order"]:
        assert r["sim_makespans"]["auto"] == r["sim_makespans"][REPLAY] == r["sim_auto"]


def test_main_prints_the_measured_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ranks", "2", "--microbatches", "2", "--measure", "--sleep", "1",
                 "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "sleep stages over threads, 1 ms a block unit" in out and "load " in out
    assert [line.split(" | ")[:2] for line in out.splitlines()
            if line.startswith("| 2 | 2 |")] == [["| 2", "2"]]


def test_sleep_needs_measure_and_a_positive_unit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--sleep", "3"])
    assert "it needs --measure and a value > 0 (got 3.0" in capsys.readouterr().err


def test_the_row_tells_another_order_under_the_same_name_from_another_candidate() -> None:
    cell = plan([2, 1], 2, head=2.0, head_w=2.0)
    other = get_schedule("gpipe", 2, 2)
    assert rows_of(other) != rows_of(cell.planned.schedule)
    times = {label: [0.1] for label in cell.labels}

    def printed(chosen: str, schedule: Schedule) -> str:
        return row(summarise(cell, UNIT, times, times, measured_costs=None, chosen=chosen,
                             schedule=schedule, cpu_s=0.0))

    assert f"| {cell.planned.chosen} | nan |" in printed(cell.planned.chosen,
                                                         cell.planned.schedule)
    assert (f"| {cell.planned.chosen} (another order for the sleeps) |"
            in printed(cell.planned.chosen, other))
    assert f"| gpipe (sleeps: {cell.planned.chosen}) |" in printed("gpipe", other)
