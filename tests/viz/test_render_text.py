"""Text rendering: golden outputs (reviewed by eye), ASCII, fitted width, colour on top."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedules
from schedules import Costs, Schedule
from tests.strategies import schedules_any
from viz import main, render_text
from viz.compare import compare

DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent / "golden"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# name -> pipeviz arguments; each drawn at 80 columns without colour. To regenerate after an
# intended change: PIPEVIZ_UPDATE_GOLDEN=1 pytest tests/viz, then read every diff by eye.
CASES = {
    "gpipe_p2_m2": ["gpipe", "-p", "2", "-m", "2"],
    "1f1b_p3_m4": ["1f1b", "-p", "3", "-m", "4"],
    "interleaved_p2_m4_v2": ["interleaved", "-p", "2", "-m", "4", "-v", "2"],
    "zb-h1_p3_m4": ["zb-h1", "-p", "3", "-m", "4"],
    "2bw_p2_m2_n2": ["2bw", "-p", "2", "-m", "2", "-n", "2", "--costs", "U=1"],
    "1f1b_p2_m3_comm": ["1f1b", "-p", "2", "-m", "3", "--costs", "F=1,B=2,comm=0.5", "--lower"],
    "torch_csv": [str(DATA / "torch_1f1b.csv")],
    "deadlock_csv": [str(DATA / "deadlock.csv")],
    "measured_1f1b": [str(DATA / "measured_1f1b.json")],
    "compare_p3_m4": ["compare", "gpipe", "1f1b", "interleaved", "zb-h1", "-p", "3", "-m", "4"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*CASES[name], "--width", "80", "--color", "never"])
    out = capsys.readouterr().out
    assert code == (1 if name == "deadlock_csv" else 0)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("PIPEVIZ_UPDATE_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text()
    assert out.isascii()
    assert max(len(line) for line in out.splitlines()) <= 80


def test_golden_cases_are_all_checked_in() -> None:
    assert {p.stem for p in GOLDEN.glob("*.txt")} == set(CASES)


def test_costs_scale_the_boxes() -> None:
    # 1F1B, p=2, m=2 with B three times F, makespan 12: 2 columns per unit fit in 40 columns,
    # so F takes 2 and B 6; rank 1 waits 1 unit for rank 0's first forward.
    text = render_text(schedules.get_schedule("1f1b", 2, 2), costs=Costs(backward=3), width=40)
    lane = next(line for line in text.splitlines() if line.startswith("rank 1"))
    assert lane == "rank 1 |..F0B0<<<<F1B1<<<<......|"


@given(schedules_any(), st.integers(40, 160))
def test_fits_the_width_and_stays_ascii(schedule: Schedule, width: int) -> None:
    text = render_text(schedule, width=width)
    assert text.isascii()
    lanes = [line for line in text.splitlines() if line.startswith("rank ") and "|" in line]
    assert len(lanes) == schedule.num_ranks
    assert all(len(line) <= width for line in lanes)


@given(schedules_any())
def test_colour_only_adds_escape_codes(schedule: Schedule) -> None:
    plain = render_text(schedule, width=90)
    coloured = render_text(schedule, width=90, color=True)
    assert "\x1b[" in coloured
    assert ANSI.sub("", coloured) == plain


def test_failing_step_is_marked_in_colour() -> None:
    bad = schedules.load_csv(DATA / "deadlock.csv")
    coloured = render_text(bad, width=60, color=True)
    assert "\x1b[41;97;1mB0!!!" in coloured  # red background on the failing 0B0
    assert "deadlock" in coloured


def test_comparison_shares_one_axis() -> None:
    c = compare([schedules.get_schedule("gpipe", 2, 4), schedules.get_schedule("zb-h1", 2, 4)])
    text = render_text(c, width=100)
    lanes = [line for line in text.splitlines() if line.startswith("rank ")]
    ends = [line.rindex("|") for line in lanes]
    # gpipe: 3(4 + 1) = 15, zb-h1: 3 * 4 + 1 = 13 units; the same scale puts the ends apart.
    assert ends[0] == ends[1] > ends[2] == ends[3]
    assert sum(line.lstrip().startswith("+-") for line in text.splitlines()) == 1  # one axis
    assert re.search(r"^zb-h1 +13 \* +7\.7% \*", text, re.M)
