"""benchmarks.demo: the batches, and a short run end to end."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.demo import _windows, main

# A small model and few steps: the whole run takes a few seconds.
_SMALL = ["--steps", "4", "--batch", "4", "--chunks", "2", "--context", "16", "--width", "32",
          "--depth", "2", "--heads", "2", "--sample", "8"]


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    # main() sets one intra-op thread (one per rank); give the rest of the session its own back.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_windows_are_contiguous_and_shifted_by_one() -> None:
    data = torch.arange(1000)
    x, y = _windows(data, 8, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16)
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    torch.testing.assert_close(x[:, 1:] - x[:, :-1], torch.ones(8, 15, dtype=torch.int64))
    again, _ = _windows(data, 8, 16, torch.Generator().manual_seed(0))
    torch.testing.assert_close(x, again)  # seeded


def test_demo_trains_untied_with_thread_ranks(tmp_path: Path,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    assert main([*_SMALL, "--untied", "--ranks", "threads", "--out", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert "head = its own weight (--untied)" in out and "ranks: threads" in out
    assert "training loss, mean of the first 1 steps" in out and "held-out loss" in out
    # Not a terminal: the progress comes as lines, one per step here (4 steps), no bar.
    assert re.findall(r"^step (\d)/4  loss \d", out, flags=re.M) == ["1", "2", "3", "4"]
    assert "\r" not in out
    assert "sampled through the pipe" in out and "CORIOLANUS:" in out
    assert "Pipe over 2 threads, 1f1b, m=2" in out and "measured bubble" in out
    timeline = json.loads((tmp_path / "demo-timeline.json").read_text())
    assert timeline["format"] == "pipeline-timeline/1"
    assert (tmp_path / "demo-trace.json").is_file()
    # The picture of the measured step, drawn by the visualizer, and how to draw it again.
    svg = (tmp_path / "demo-timeline.svg").read_text()
    assert svg.startswith("<svg") or svg.startswith("<?xml")
    assert svg.count('class="action') == len(timeline["events"])
    assert f"picture of the measured step: {tmp_path / 'demo-timeline.svg'}" in out
    assert (f"redraw it: pipeviz {tmp_path / 'demo-timeline.json'} -o "
            f"{tmp_path / 'demo-timeline.svg'}") in out
    # The step times carry the load and the CPU time they got.
    assert re.search(r"load average [\d.]+ on \d+ cores; share of the CPU time the threads "
                     r"could use: pipe \d+%, plain, 1 thread \d+%", out)
    speed = json.loads((tmp_path / "demo-speed.json").read_text())
    assert set(speed["step_s"]) == set(speed["contention"]) and "pipe" in speed["step_s"]
    assert {"cpu_s", "wall_s", "load_before", "contended"} <= set(speed["contention"]["pipe"])


@pytest.mark.parametrize("rule", ["others", "fallback"])
def test_the_demo_marks_step_times_measured_under_contention(
        tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    """A plain model on 2 threads once printed 3885.7 ms beside 387.2 ms on 1 thread, with
    nothing to say the machine was busy: other programs' CPU time over the stretch (read from
    /proc/stat) now marks every figure; where /proc/stat is missing, a load above the cores."""
    if rule == "others":  # the machine busy 100 CPU seconds more at each read than before
        busy = iter(range(0, 10**6, 100))
        monkeypatch.setattr("pipeline.planner.contention.machine_busy", lambda: next(busy))
    else:
        monkeypatch.setattr("pipeline.planner.contention.machine_busy", lambda: None)
        monkeypatch.setattr("pipeline.planner.contention.load_average", lambda: 99.0)
    assert main([*_SMALL, "--sample", "0", "--ranks", "threads", "--out", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    cores = os.cpu_count()
    assert re.search(r"Pipe over 2 threads, 1f1b, m=2: [\d.]+ ms \*$", out, flags=re.M)
    assert re.search(rf"^  plain, {cores} threads: [\d.]+ ms \* \(the Pipe's speedup "
                     rf"[\d.]+x\*\)$", out, flags=re.M), out
    assert "* measured under contention" in out
    why = (r"other programs took [\d.]+ CPUs on average" if rule == "others"
           else rf"(.*; )?the load average was 99.0 on {cores} cores")
    assert re.search(rf"^    plain, 1 thread: {why}", out, flags=re.M), out
    speed = json.loads((tmp_path / "demo-speed.json").read_text())
    assert all(r["contended"] for r in speed["contention"].values())


@pytest.mark.dist
def test_demo_runs_its_ranks_as_processes_with_the_head_tied_across_them(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The main job on CPU: one process per rank; one rank prints, and the report holds the
    plain model on one thread and on every core beside the Pipe."""
    assert main([*_SMALL, "--out", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert "tied across stages 0 and 1" in out and "ranks: processes" in out
    assert out.count("held-out loss") == 1  # printed once, by rank 0
    assert "Pipe over 2 processes (same-host links), 1f1b, m=2" in out
    assert "plain, 1 thread:" in out and f"plain, {os.cpu_count()} threads:" in out
    assert "what the pipeline buys here" in out and "on accelerators" in out
    timeline = json.loads((tmp_path / "demo-timeline.json").read_text())
    assert {e[0] for e in timeline["events"]} == {0, 1}  # both processes' actions


def test_depth_below_two_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--depth", "1"])


def test_make_demo_installs_only_what_the_demo_needs_and_says_so(tmp_path: Path) -> None:
    """`make demo` once installed the development stack (pytest, hypothesis, ruff, mypy,
    transformers, peft, torchft) with `pip -q`: minutes without a word. Now: the pinned torch,
    then the package, each shown, into a stamp of its own; `make test` keeps its own."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    root = Path(__file__).resolve().parents[2]
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(root / name, tmp_path / name)
    # As a user types it: under `make test` the outer make's MAKELEVEL would have this one
    # print "Entering directory" lines around its plan.
    clean = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MAKELEVEL", "MFLAGS"}}
    plan = subprocess.run(["make", "-n", "demo"], cwd=tmp_path, capture_output=True,
                          text=True, check=True, timeout=60, env=clean).stdout
    installs = [line.strip(" \t\\&;") for line in plan.splitlines() if "pip install" in line]
    assert installs == [".venv/bin/python -m pip install --upgrade pip",
                        ".venv/bin/python -m pip install torch==2.13.0",
                        ".venv/bin/python -m pip install -e ."], plan
    assert "make demo: installing torch==2.13.0, then this package" in plan
    assert "touch .venv/.demo-installed" in plan and "[dev]" not in plan
    assert plan.rstrip().endswith(".venv/bin/python -m benchmarks.demo")
