"""benchmarks/auto_sleep_procs.py: the sleep-stage cells with each rank a process run end to
end, a step is timed from the first rank's start to the last rank's end, and the ranks must
agree on auto's order (no speed asserted)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import auto_sleep_procs
from benchmarks.auto_schedule import main
from benchmarks.auto_sleep import HEADER, REPLAY, plan, rows_of
from benchmarks.auto_sleep_procs import OrdersDiffer, measure_cell_processes
from schedules import get_schedule
from tests.limits import SPAWN_TIMEOUT

LABELS = {"auto", REPLAY, "gpipe", "1f1b", "zb-h1", "zb-h2", "zb-h1-tight"}  # m = p: all fit


@pytest.mark.dist
def test_main_runs_the_cells_over_processes_and_every_rank_ran_autos_order(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cells: list[dict[str, Any]] = []

    def keep(*args: Any, **kwargs: Any) -> dict[str, Any]:
        r = measure_cell_processes(*args, **kwargs, timeout=SPAWN_TIMEOUT)
        cells.append(r)
        return r

    monkeypatch.setattr(auto_sleep_procs, "measure_cell_processes", keep)
    assert main(["--ranks", "2", "--microbatches", "2", "--measure", "--sleep", "1",
                 "--steps", "2", "--transport", "processes"]) == 0
    out = capsys.readouterr().out
    assert "sleep stages over processes, 1 ms a block unit" in out
    assert "the ranks' CPU time in the cells" in out
    lines = out.splitlines()
    header = HEADER.splitlines()[0]
    assert header in lines
    rows = [line for line in lines if line.startswith("| 2 | 2 |")]
    assert len(rows) == 1 and rows[0].count("|") == header.count("|")
    [r] = cells
    assert set(r["median_s"]) == set(r["queued_s"]) == set(r["sim_makespans"]) == LABELS
    assert all(v > 0 for v in r["median_s"].values())
    # Both ranks ran the order auto synthesised from the costs they exchanged: one order, and
    # the one the result reports (rank 0's), with every stage's costs measured.
    assert len(r["orders"]) == 2 and r["orders"][0] == r["orders"][1]
    assert r["measured_costs"] is not None and len(r["measured_costs"].forward) == 2
    assert r["profile"] >= 1.0  # a sleep lasts at least its time, on whichever rank
    assert r["chosen"] in rows[0]


def _fake_ranks(schedules: list[Any], labels: list[str], steps: int) -> list[dict[str, Any]]:
    """What `run_rank` returns, per rank: rank n starts each step n ms late and ends 10 ms
    later than rank 0 does."""
    return [{"spans": {label: [(100.0 * i + n / 1000, 100.0 * i + 1 + n / 100)
                               for i in range(steps)] for label in labels},
             "queued": {label: [0.001] * steps for label in labels}, "costs": None,
             "chosen": "zb-h1", "schedule": schedule, "cpu_s": 1.0}
            for n, schedule in enumerate(schedules)]


def test_a_step_runs_from_the_first_start_to_the_last_end_summed_over_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cell = plan([2, 1], 2, head=2.0, head_w=2.0)
    schedule = cell.planned.schedule
    monkeypatch.setattr(auto_sleep_procs, "spawn", lambda fn, p, *args, timeout: _fake_ranks(
        [schedule] * p, cell.labels, 3))
    r = measure_cell_processes([2, 1], 2, head=2.0, head_w=2.0, unit=1e-3, steps=3)
    # Rank 0 starts first, rank 1 ends last: 1.01 s from one to the other.
    assert r["median_s"] == {label: pytest.approx(1.01) for label in cell.labels}
    assert r["queued_s"] == {label: pytest.approx(0.002) for label in cell.labels}
    assert r["cpu_s"] == 2.0 and r["orders"] == [rows_of(schedule)] * 2 and r["same_order"]


def test_ranks_that_ran_different_orders_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cell = plan([2, 1], 2, head=2.0, head_w=2.0)
    other = get_schedule("gpipe", 2, 2)
    assert rows_of(other) != rows_of(cell.planned.schedule)
    monkeypatch.setattr(auto_sleep_procs, "spawn", lambda fn, p, *args, timeout: _fake_ranks(
        [cell.planned.schedule, other], cell.labels, 1))
    with pytest.raises(OrdersDiffer, match=r"rank\(s\) \[1\] ran another than rank 0"):
        measure_cell_processes([2, 1], 2, head=2.0, head_w=2.0, unit=1e-3, steps=1)


def test_a_bad_transport_is_refused_naming_the_choices(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--measure", "--sleep", "3", "--transport", "mpi"])
    err = capsys.readouterr().err
    assert "--transport: invalid choice: 'mpi'" in err and "'processes'" in err


def test_processes_need_the_sleep_stages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--measure", "--transport", "processes"])
    assert "it needs --measure --sleep MS (got --sleep None" in capsys.readouterr().err
