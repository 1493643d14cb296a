"""`pipeviz plan`: the plan, its candidates and the two best predicted timelines."""

from __future__ import annotations

import argparse
import importlib
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from viz import main
from viz.plan import parse_bytes, resolve_model

_TINY = ["plan", "pipeline.examples.models:MODELS.tiny", "--ranks", "2", "--chunks", "1,2",
         "--schedules", "1f1b,gpipe,zb-h1", "--threads", "1"]


@pytest.fixture
def quick_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan` measures the link and the ranks' contention for real, briefly: by default the
    contention alone sleeps out 9 windows of 0.3 s, a wait each call would repeat for tests
    about what the command prints (test_plan_prints_the_plan... keeps the defaults)."""
    planning = importlib.import_module("pipeline.planner.plan")  # the module, not plan()

    def briefly(measure: Callable[..., Any], **short: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: measure(*args, **{**kwargs, **short})

    monkeypatch.setattr(planning, "measure_contention",
                        briefly(planning.measure_contention, seconds=0.02, repeats=1))
    monkeypatch.setattr(planning, "measure_link", briefly(planning.measure_link, repeats=3))


def test_budgets_read_with_units() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2e9
    assert parse_bytes("1e6") == 1e6
    assert parse_bytes("none") is None
    for bad in ("lots", "12 parsecs", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_models_are_named_as_module_and_attribute() -> None:
    model, x, y, loss = resolve_model("pipeline.examples.models:MODELS.tiny")
    assert len(model) == 5 and x.shape[0] == y.shape[0] == 16 and callable(loss)


def test_plan_prints_the_plan_the_candidates_and_the_two_best(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_TINY) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: ")
    assert "predicted step" in out and "predicted peak per rank" in out
    assert "schedule" in out and "chosen" in out and "status" in out
    assert "chosen vs runner-up" in out and "; predicted" in out
    assert "rank 1 |" in out


@pytest.mark.usefixtures("quick_measures")
def test_a_profile_measured_under_contention_is_flagged(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's times come from a profile: other programs' CPU time puts them in doubt, or,
    where the machine's busy time is unknown (no /proc/stat), a load above the cores."""
    monkeypatch.setattr("pipeline.planner.contention.load_average", lambda: 99.0)
    monkeypatch.setattr("pipeline.planner.contention.proc_stat", lambda: None)
    assert main(_TINY) == 0
    captured = capsys.readouterr()
    assert re.search(r"^pipeviz plan: profiled and planned in [\d.]+ s, [\d.]+ s of CPU "
                     r"\(\d+% of a thread\); load average 99.0 on \d+ cores; other programs "
                     r"took an unknown share of the CPUs$", captured.err, flags=re.M)
    flag = next(line for line in captured.out.splitlines() if line.startswith("* "))
    assert "profiled under contention" in flag and "the load average was 99.0" in flag
    # The machine busier by 3 CPUs than this process all along: others took the CPUs.
    monkeypatch.setattr("pipeline.planner.contention.machine_busy",
                        lambda: 3 * time.perf_counter())
    monkeypatch.setattr("pipeline.planner.contention.cpu_seconds",
                        lambda *, children=False: 0.0)
    assert main(_TINY) == 0
    captured = capsys.readouterr()
    flag = next(line for line in captured.out.splitlines() if line.startswith("* "))
    assert re.search(r"other programs took 3\.\d\d CPUs on average", flag), flag
    assert "the load average" not in flag


@pytest.mark.usefixtures("quick_measures")
def test_a_profile_that_had_its_cpu_is_not_flagged(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.planner.contention.load_average", lambda: 0.5)
    # As if this process ran all the time it was timed (on a loaded machine it need not).
    monkeypatch.setattr("pipeline.planner.contention.cpu_seconds",
                        lambda *, children=False: time.perf_counter())
    monkeypatch.setattr("pipeline.planner.contention.wall_clock", time.perf_counter)
    # ... and as if the machine's busy time were all this process's.
    monkeypatch.setattr("pipeline.planner.contention.machine_busy", time.perf_counter)
    assert main(_TINY) == 0
    captured = capsys.readouterr()
    assert "load average 0.5 on" in captured.err
    assert "contention" not in captured.out


@pytest.mark.usefixtures("quick_measures")
def test_a_budget_nothing_fits_names_the_least(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_TINY, "--memory", "1KiB"]) == 1
    captured = capsys.readouterr()
    assert "the smallest budget that fits is" in captured.err
    assert "over budget" in captured.out


@pytest.mark.usefixtures("quick_measures")
def test_svg_goes_to_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.svg"
    assert main([*_TINY, "-o", str(out)]) == 0
    assert out.read_text().lstrip().startswith("<svg")
    assert "plan: " in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["plan", "nomodule", "--ranks", "2"], "module:name"),
    (["plan", "pipeline.examples.models:MODELS.nope", "--ranks", "2"], "no 'nope'"),
    (["plan", "pipeline.examples.models:MODELS.tiny", "--ranks", "0"], "--ranks must be >= 1"),
    (["plan", "pipeline.examples.models:MODELS.tiny", "--ranks", "2", "--memory", "x"],
     "bytes like"),
    (["plan", "pipeline.examples.models:MODELS.tiny", "--ranks", "2", "--schedules", "2f2b"],
     "registered schedules"),
])
def test_bad_arguments_get_one_line(args: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_tp_plans_read_as_patterns_and_styles() -> None:
    from viz.plan import parse_tp_plan

    assert parse_tp_plan("*.qkv=colwise, *.proj=rowwise") == {"*.qkv": "colwise",
                                                              "*.proj": "rowwise"}
    for bad in ("*.qkv", "*.qkv=diagonal", ",", "=colwise"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tp_plan(bad)


_TP = ["plan", "pipeline.examples.models:MODELS.transformer", "--ranks", "2", "--chunks", "1,2",
       "--schedules", "1f1b,gpipe", "--threads", "1", "--tp-plan",
       "*.qkv=colwise,*.proj=rowwise,*.up=colwise,*.down=rowwise"]


def test_plan_searches_tp_and_shows_the_3d_shape(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    from pipeline.planner import Link

    # Two gloo processes would be measured otherwise; a fixed link keeps this test quick.
    planning = importlib.import_module("pipeline.planner.plan")  # the module, not plan()
    monkeypatch.setattr(planning, "measure_link", lambda *a, **k: Link("gloo", 2e-5, 1e-9))
    monkeypatch.setattr(planning, "measure_contention", lambda *a, **k: 1.0)
    assert main([*_TP, "--transport", "gloo", "--show", "0"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("plan: ") and " x tp " in first
    assert "dp x pp x tp" in out and "tensor parallelism within hosts of 2 ranks" in out
    assert " 1 x 1 x 2 " in out and " 1 x 2 x 1 " in out  # both shapes were candidates


def test_tp_needs_processes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_TP) == 2
    assert "tensor parallelism runs one process per rank" in capsys.readouterr().err


@pytest.mark.usefixtures("quick_measures")
def test_progress_is_shown_on_stderr_unless_asked_not_to(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_TINY) == 0
    err = capsys.readouterr().err
    for phase in ("profiling", "measuring the link and contention", "searching"):
        assert re.search(rf"pipeviz plan: {phase}: 100%\|", err), phase
    assert main([*_TINY, "--no-progress"]) == 0
    # No bar; a contention warning may still say "(100% of a thread)".
    assert "100%|" not in capsys.readouterr().err


@pytest.mark.usefixtures("quick_measures")
def test_a_high_load_is_warned_of_before_profiling(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.planner.contention.load_average", lambda: 99.0)
    assert main(_TINY) == 0
    err = capsys.readouterr().err
    warning = err.index("pipeviz plan: warning: the load average is 99.0 on")
    assert warning < err.index("pipeviz plan: profiling")
    assert "one thread's CPU time, which the load does not move" in err
    monkeypatch.setattr("pipeline.planner.contention.load_average", lambda: 0.5)
    assert main(_TINY) == 0
    assert "warning" not in capsys.readouterr().err


def _listed(out: str) -> int:
    table = out.split("\n\n")[1].splitlines()
    return sum(1 for line in table[1:] if not line.startswith("..."))


@pytest.mark.usefixtures("quick_measures")
def test_show_sets_the_candidates_listed_and_rows_is_its_deprecated_alias(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_TINY, "--show", "2"]) == 0
    captured = capsys.readouterr()
    assert _listed(captured.out) == 2 and "deprecated" not in captured.err
    assert main([*_TINY, "--rows", "3"]) == 0
    captured = capsys.readouterr()
    assert _listed(captured.out) == 3
    assert "--rows is deprecated" in captured.err and "use --show N" in captured.err


def test_every_option_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--show N" in out and "--no-progress" in out and "--rows" not in out
    options = out[out.index("options:"):]
    transport = options[options.index("--transport"):options.index("--schedules")]
    assert "how the ranks talk" in transport


@pytest.mark.usefixtures("quick_measures")
def test_the_last_choice_is_remembered_unless_fresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path))
    assert main([*_TINY, "--fresh", "--no-progress"]) == 0
    assert not (tmp_path / "plans").exists()  # afresh: nothing read, nothing written
    assert "last choice" not in capsys.readouterr().out
    assert main([*_TINY, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "no last choice for this model and settings: chose " in out
    assert f"remembered in {tmp_path / 'plans'}" in out
    (path,) = (tmp_path / "plans").iterdir()
    assert main([*_TINY, "--no-progress"]) == 0
    said = next(line for line in capsys.readouterr().out.splitlines() if "last choice" in line)
    assert said.startswith(("kept the last choice", "chose ")), said
    path.write_text("{damaged")
    assert main([*_TINY, "--no-progress"]) == 0
    captured = capsys.readouterr()
    warned = [line for line in captured.err.splitlines() if "last choice is ignored" in line]
    assert warned == [f"pipeviz plan: warning: the planner's last choice is ignored: "
                      f"{str(path)!r} is not JSON (Expecting property name enclosed in double "
                      f"quotes: line 1 column 2 (char 1))"]
    assert "the last choice's file was ignored" in captured.out
