"""`pipeviz` through `main(argv)`: every input, every format, every way to get it wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import schedules
from schedules import Timeline
from viz import main

DATA = Path(__file__).parent / "data"
MEASURED = str(DATA / "measured_1f1b.json")
TORCH_CSV = str(DATA / "torch_1f1b.csv")
LOWERED_CSV = str(DATA / "lowered_1f1b.csv")
DEADLOCK_CSV = str(DATA / "deadlock.csv")
SVG = "{http://www.w3.org/2000/svg}"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _svg_actions(text: str) -> list[str]:
    root = ET.fromstring(text)
    return [r.get("data-action", "") for r in root.iter(f"{SVG}rect")
            if "action" in r.get("class", "")]


# --- every input, every format ---------------------------------------------------------------

@pytest.mark.parametrize("source", [["1f1b", "-p", "3", "-m", "4"], [TORCH_CSV], [LOWERED_CSV],
                                    [MEASURED]])
def test_text(capsys: pytest.CaptureFixture[str], source: list[str]) -> None:
    code, out, err = run(capsys, *source, "--width", "72")
    assert code == 0 and err == ""
    assert out.isascii() and "\x1b" not in out  # captured stdout is no terminal
    assert "bubble" in out and "peak activations" in out


@pytest.mark.parametrize("source", [["zb-h1", "-p", "2", "-m", "3"], [TORCH_CSV], [MEASURED]])
def test_svg(capsys: pytest.CaptureFixture[str], tmp_path: Path, source: list[str]) -> None:
    out_file = tmp_path / "x.svg"
    code, out, err = run(capsys, *source, "-o", str(out_file))  # format from the suffix
    assert code == 0 and out == "" and err == ""
    actions = _svg_actions(out_file.read_text())
    assert len(actions) == {"zb-h1": 18, TORCH_CSV: 8, MEASURED: 12}[source[0]]


def test_svg_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "gpipe", "-p", "2", "-m", "2", "--format", "svg")
    assert code == 0 and len(_svg_actions(out)) == 8


@pytest.mark.parametrize("source", [["interleaved", "-p", "2", "-m", "2", "-v", "2"],
                                    [LOWERED_CSV], [MEASURED]])
def test_png(capsys: pytest.CaptureFixture[str], tmp_path: Path, source: list[str]) -> None:
    image_mod = pytest.importorskip("PIL.Image")
    out_file = tmp_path / "x.png"
    code, _, err = run(capsys, *source, "-o", str(out_file))
    assert code == 0 and err == ""
    with image_mod.open(out_file) as image:
        assert image.format == "PNG" and image.size[0] == 2000


@pytest.mark.parametrize("source,count", [(["1f1b", "-p", "2", "-m", "3"], 12),
                                          ([LOWERED_CSV], 24), ([MEASURED], 12)])
def test_chrome(capsys: pytest.CaptureFixture[str], tmp_path: Path, source: list[str],
                count: int) -> None:
    out_file = tmp_path / "trace.json"
    code, _, _ = run(capsys, *source, "-o", str(out_file))  # .json: a Chrome trace
    assert code == 0
    trace = json.loads(out_file.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == count
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["dur"] >= 0
    names = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in names] == ["rank 0", "rank 1"]


def test_chrome_of_a_measured_run_is_in_microseconds(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, MEASURED, "--format", "chrome")
    timeline = Timeline.from_json(Path(MEASURED).read_text())
    first = min(timeline.events, key=lambda e: e.start)
    event = next(e for e in json.loads(out)["traceEvents"] if e["name"] == str(first.action))
    assert code == 0 and event["ts"] == pytest.approx(first.start * 1e6)


def test_json_round_trips_through_pipeviz(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    code, out, _ = run(capsys, "2bw", "-p", "2", "-m", "2", "-n", "2", "--format", "json")
    assert code == 0
    timeline = Timeline.from_json(out)
    planned = schedules.simulate(schedules.get_schedule("2bw", 2, 2, num_batches=2))
    assert timeline.events == planned.events and timeline.unit == "cost"
    assert timeline.meta["costs"] == "F=1 B=2 I=1 W=1 U=0 comm=0"
    path = tmp_path / "t.json"
    path.write_text(out)
    code, text, _ = run(capsys, str(path), "--width", "100")
    assert code == 0 and "costs F=1 B=2 I=1 W=1 U=0 comm=0; planned" in text


@pytest.mark.parametrize("source", [["1f1b", "-p", "2", "-m", "2"], [TORCH_CSV]])
def test_dot_source(capsys: pytest.CaptureFixture[str], source: list[str]) -> None:
    code, out, _ = run(capsys, *source, "--format", "dot")
    assert code == 0
    # 1F1B, p=2, m=2: 6 same-rank order edges and 8 data edges, 2 of them the same pair.
    assert out.startswith("digraph schedule {") and out.count("->") == 12


def test_dot_rendered_when_graphviz_is_there(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    if shutil.which("dot") is None:
        pytest.skip("graphviz's dot program is not installed")
    out_file = tmp_path / "graph.svg"
    code, _, err = run(capsys, "1f1b", "-p", "2", "-m", "3", "-f", "dot", "-o", str(out_file))
    assert code == 0 and err == ""
    assert ET.fromstring(out_file.read_bytes()).tag == f"{SVG}svg"


def test_dot_without_graphviz_writes_source_and_says_how_to_render(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out_file = tmp_path / "graph.png"
    code, _, err = run(capsys, "1f1b", "-p", "2", "-m", "3", "-f", "dot", "-o", str(out_file))
    assert code == 0 and not out_file.exists()
    assert (tmp_path / "graph.dot").read_text().startswith("digraph")
    # The picture asked for, by its name: not graph.svg whatever was asked.
    assert f"dot -Tpng {tmp_path / 'graph.dot'} -o {out_file}" in err
    code, out, err = run(capsys, "1f1b", "-p", "2", "-m", "3", "-f", "dot")
    assert code == 0 and out.startswith("digraph") and "dot -Tsvg" in err


# --- compare ------------------------------------------------------------------------------------

def test_compare_text_and_svg(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["compare", "gpipe", "1f1b", "interleaved", "zb-h1", "--ranks", "4",
            "--microbatches", "8"]
    code, out, _ = run(capsys, *argv, "--width", "100")
    assert code == 0
    assert "interleaved: 4 ranks, 8 stages (loop), 8 micro-batches" in out
    assert "interleaved                   28.5    15.8%" in out
    assert "zb-h1                         27 *  11.1% *" in out
    out_file = tmp_path / "c.svg"
    code, _, _ = run(capsys, *argv, "--format", "svg", "-o", str(out_file))
    assert code == 0 and len(_svg_actions(out_file.read_text())) == 64 + 64 + 128 + 96


def test_compare_passes_options_to_the_schedules_that_take_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", "1f1b", "interleaved", "2bw", "-p", "2", "-m", "4",
                       "-v", "3", "-n", "2", "--width", "100")
    assert code == 0
    assert "interleaved: 2 ranks, 6 stages" in out and "x 2 batches" in out


def test_compare_with_an_invalid_csv_draws_it_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "compare", "1f1b", DEADLOCK_CSV, "-p", "2", "-m", "2")
    assert code == 1
    assert "INVALID deadlock.csv" in out and "deadlock.csv is not a valid schedule" in err


# --- invalid schedules: drawn, exit 1 -------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["text", "svg", "chrome", "dot", "json"])
def test_invalid_csv_is_drawn_with_exit_1(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    code, out, err = run(capsys, DEADLOCK_CSV, "--format", fmt)
    assert code == 1
    # Without graphviz's dot program, --format dot also says it wrote the source instead.
    lines = [line for line in err.splitlines() if not line.startswith("pipeviz: wrote DOT")]
    assert len(lines) == 1
    assert lines[0].startswith("pipeviz: deadlock.csv is not a valid schedule: deadlock:")
    assert "0B0" in out
    if fmt in ("text", "svg", "dot"):
        assert "rank 0 step 0 (0B0) waits for 0F0, 1B0" in out


# --- colour -------------------------------------------------------------------------------------

class _Terminal:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("env,flag,coloured", [
    ({}, [], True), ({"NO_COLOR": "1"}, [], False), ({"NO_COLOR": ""}, [], True),
    ({"TERM": "dumb"}, [], False), ({"NO_COLOR": "1"}, ["--color", "always"], True),
    ({}, ["--color", "never"], False)])
def test_colour_on_a_terminal_unless_asked_not_to(monkeypatch: pytest.MonkeyPatch,
                                                  env: dict[str, str], flag: list[str],
                                                  coloured: bool) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["1f1b", "-p", "2", "-m", "2", "--width", "60", *flag]) == 0
    assert ("\x1b[" in terminal.text) == coloured


def test_text_fits_the_terminal(capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "64")
    code, out, _ = run(capsys, "1f1b", "-p", "4", "-m", "8")
    assert code == 0 and max(map(len, out.splitlines())) <= 64


# --- bad arguments: one line, exit 2 ------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["nope"], "unknown schedule 'nope'; known: gpipe, 1f1b, interleaved, 2bw, zb-h1"),
    (["1f1b", "--ranks", "0"], "argument -p/--ranks: expected a whole number >= 1, got 0"),
    (["1f1b", "--microbatches", "x"], "expected a whole number >= 1, got 'x'"),
    (["1f1b", "--costs", "F=fast"], "bad cost 'F=fast'"),
    (["1f1b", "--costs", "Q=1"], "NAME one of F, B, I, W, U, comm"),
    (["gpipe", "--stages-per-rank", "2"], "takes no option stages_per_rank"),
    (["interleaved", "--stages-per-rank", "1"], "interleaved needs stages_per_rank >= 2"),
    (["1f1b", "--format", "gif"], "argument -f/--format: invalid choice: 'gif'"),
    (["1f1b", "--bogus"], "unrecognized arguments: --bogus"),
    (["1f1b", "2bw"], "give one source, not 2"),
    (["1f1b", "-f", "png"], "png is binary: give -o FILE.png"),
    (["1f1b", "--width", "20"], "--width must be at least 40 columns (got 20)"),
    (["1f1b", "-p", "8", "-m", "64", "-f", "dot"], "has 1024 actions, more than 400"),
    (["missing.csv"], "no such file: missing.csv"),
    ([TORCH_CSV, "--ranks", "4"], "--ranks applies to named schedules; a CSV gives its own"),
    ([MEASURED, "--costs", "F=2", "--lower"], "--costs, --lower apply to named schedules"),
    ([MEASURED, "-f", "dot"], "--format dot draws a schedule's dependencies"),
    (["compare"], "compare needs at least one schedule"),
    (["compare", "1f1b", "gpipe", "-f", "chrome"], "compare draws text, svg or png, not chrome"),
    (["compare", "1f1b", "gpipe", "-v", "2"], "--stages-per-rank applies to none of 1f1b, gpipe"),
    (["compare", "1f1b", MEASURED], "cannot compare measured timelines"),
    ([], "the following arguments are required: SOURCE"),
])
def test_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("pipeviz: error: ")
    assert message in err


@pytest.mark.parametrize("content,message", [
    ("0F0,0X1\n", "column 1: cannot parse action '0X1'"),
    ('{"format": "other"}', "not a pipeline timeline"),
    ('{"format": "pipeline-timeline/1", "num_ranks": 1, "events": [[1, "0F0", 0, 1]]}',
     "event 0F0 on rank 1, outside 0..0"),
    ('{"format": "pipeline-timeline/1", "num_ranks": 1, "events": [[-1, "0F0", 0, 1]]}',
     "on rank -1, outside"),
    ('{"format": "pipeline-timeline/1", "num_ranks": 1, "events": [[0, "0F0", 2, 1]]}',
     "runs from 2.0 to 1.0"),
    ('{"format": "pipeline-timeline/1", "num_ranks": 0, "events": []}', "num_ranks must be"),
    ("{not json", "malformed timeline JSON"),
])
def test_bad_input_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str,
                         message: str) -> None:
    path = tmp_path / ("in.json" if content.startswith("{") else "in.csv")
    path.write_text(content)
    code, _, err = run(capsys, str(path))
    assert code == 2 and len(err.splitlines()) == 1 and message in err


def test_a_directory_is_named_as_one(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory was once reported as 'no such file' (or, without a slash, an unknown
    schedule)."""
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    for source in (str(tmp_path), "runs"):
        code, _, err = run(capsys, source)
        assert code == 2 and len(err.splitlines()) == 1
        assert f"{source} is a directory; give a schedule name (gpipe, 1f1b" in err
        assert "a .csv schedule file or a .json timeline file" in err


def test_unwritable_output(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "1f1b", "-o", str(tmp_path / "no" / "such" / "dir.svg"))
    assert code == 2 and "cannot write" in err and len(err.splitlines()) == 1


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    assert "examples:" in out and "pipeviz compare gpipe 1f1b interleaved zb-h1" in out
    assert "gpipe, 1f1b, interleaved, 2bw, zb-h1" in out


def test_python_dash_m_viz() -> None:
    result = subprocess.run([sys.executable, "-m", "viz", "gpipe", "-p", "2", "-m", "1",
                             "--width", "60"], capture_output=True, text=True, check=False,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0 and result.stdout.startswith("gpipe\n")
    result = subprocess.run([sys.executable, "-m", "viz", "nope"], capture_output=True,
                            text=True, check=False, cwd=Path(__file__).parents[2])
    assert result.returncode == 2 and result.stderr.count("\n") == 1


def test_viz_imports_neither_torch_nor_graphviz() -> None:
    # torch is never needed to draw; graphviz and Pillow only when DOT or PNG output is asked for.
    code = "import sys, viz; print(sorted({'torch', 'graphviz', 'PIL'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).parents[2])
    assert result.stdout.strip() == "[]"


# --- absurd inputs: refused at once, by the documented limits -----------------------------------

_DIGITS = "9" * 5000


@pytest.mark.parametrize("argv,content,message", [
    (["1f1b", "--costs", "F=nan"], None, "Costs.forward must be a finite number >= 0 (got nan)"),
    (["1f1b", "--costs", "comm=inf"], None, "Costs.comm must be a finite number >= 0 (got inf)"),
    (["1f1b", "--ranks", "100000", "--microbatches", "100000"], None,
     "at most 256 ranks (got 100000)"),
    (["1f1b", "--ranks", "200", "--microbatches", "200"], None,
     "1f1b on 200 ranks x 200 micro-batches has at least 80000 compute actions; pipeviz draws "
     "at most 10000"),
    (["interleaved", "-p", "8", "-m", "8", "-v", "100000"], None, "at most 256 stages per rank"),
    ([], "0F0,,0B0\n,99999999F0,\n", "stage, micro-batch and version numbers are at most 9999 "
     "(got 99999999)"),
    ([], f"0F{_DIGITS}\n", "numbers are at most 9999 (got a 5000-digit number)"),
    ([], "0F0\n" * 300, "at most 256 ranks (got 300 rows)"),
    ([], '{"format": "pipeline-timeline/1", "num_ranks": 1e9, "events": []}',
     "at most 256 ranks (got num_ranks 1e+09)"),
    ([], '{"format": "pipeline-timeline/1", "num_ranks": 1000000000, "events": []}',
     "at most 256 ranks (got num_ranks 1000000000)"),
    ([], '{"format": "pipeline-timeline/1", "num_ranks": ' + _DIGITS + ', "events": []}',
     "got a 5000-digit number"),
    ([], '{"format": "pipeline-timeline/1", "num_ranks": 1, "events": [[0, "99999999F0", 0, 1]]}',
     "numbers are at most 9999 (got 99999999)"),
    ([], '{"format": "pipeline-timeline/1", "num_ranks": 1, "events": [[0, "0F0", 0, 1e400]]}',
     "times must be finite"),
])
def test_absurd_inputs_get_one_line_and_exit_2_within_a_second(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str],
        content: str | None, message: str) -> None:
    if content is not None:
        path = tmp_path / ("in.json" if content.startswith("{") else "in.csv")
        path.write_text(content)
        argv = [str(path)]
    # CPU seconds, not wall-clock ones: "at once" is about the work done (drawing even the
    # 10000 actions allowed takes about half a CPU second), and a loaded machine stretches
    # wall time several-fold, not CPU time.
    start = time.process_time()
    code, out, err = run(capsys, *argv, "--width", "80")
    assert time.process_time() - start < 1.0
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("pipeviz: error: ")
    assert message in err, err


def test_the_largest_named_schedule_allowed_is_drawn(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "gpipe", "-p", "50", "-m", "100", "--width", "80")
    assert code == 0 and "rank 49" in out


def test_syncs_draw_the_program(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--syncs places a step's syncs: a mark and a legend entry in text, a strip in SVG, and the
    JSON timeline holds every sync action."""
    args = ["1f1b", "-p", "2", "-m", "2", "--syncs", "ties=0:1 dp scaler", "--costs",
            "REDUCE_GRAD=1.5,OVERFLOW=0.5"]
    assert main([*args, "--width", "80", "--color", "never"]) == 0
    text = capsys.readouterr().out
    assert "sync (ties, dp, scaler)" in text and "Rd1***" in text
    assert main([*args, "-o", str(tmp_path / "p.svg")]) == 0
    assert 'class="action op-sync"' in (tmp_path / "p.svg").read_text()
    assert main([*args, "-f", "json"]) == 0
    ops = {e.action.op for e in Timeline.from_json(capsys.readouterr().out).events}
    assert ops >= schedules.SYNC_OPS
    assert main(["1f1b", "-p", "2", "-m", "2", "--syncs", "ties=0:5"]) == 2
    assert "name stage 5" in capsys.readouterr().err


def test_dot_without_graphviz_names_the_files_it_wrote_and_asked_for(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`-f dot -o g.svg` without graphviz wrote g.dot but said to render graph.svg."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out_file = tmp_path / "g.svg"
    code, _, err = run(capsys, "1f1b", "-p", "2", "-m", "3", "-f", "dot", "-o", str(out_file))
    assert code == 0 and (tmp_path / "g.dot").read_text().startswith("digraph")
    assert f"wrote DOT source to {tmp_path / 'g.dot'}" in err
    assert f"dot -Tsvg {tmp_path / 'g.dot'} -o {out_file}" in err
    assert "graph.svg" not in err


def test_the_usage_line_names_compare_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    usage = out.split("\n\n")[0]
    assert code == 0
    assert "pipeviz compare SOURCE SOURCE" in usage and "pipeviz plan MODEL" in usage


def _measured(tmp_path: Path) -> Path:
    """A 1f1b step of 2 ranks timed in seconds (a few ms), as a run records it."""
    planned = schedules.simulate(schedules.get_schedule("1f1b", 2, 3),
                                 schedules.Costs(forward=0.002, backward=0.004, comm=0.0005))
    meta = {"schedule": "1f1b", "num_ranks": 2, "num_microbatches": 3}
    path = tmp_path / "run.json"
    path.write_text(Timeline(planned.num_ranks, planned.events, "s", meta).to_json())
    return path


def test_measured_over_predicted_says_the_axis_unit_and_stars_nothing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Its subtitle said "seconds" over an axis in ms, and "* best of the compared schedules"
    was stamped on one schedule measured and predicted."""
    code, out, err = run(capsys, str(_measured(tmp_path)), "--predicted", "--color", "never")
    assert code == 0, err
    assert "seconds" not in out and "2 ranks; times in ms;" in out
    assert "best of the compared schedules" not in out and " *" not in out
    code, out, _ = run(capsys, str(_measured(tmp_path)), "--predicted", "-f", "svg")
    assert code == 0 and "seconds" not in out and "best of the compared" not in out
    code, out, _ = run(capsys, "compare", "gpipe", "1f1b", "-p", "2", "-m", "3")
    assert code == 0 and "* best of the compared schedules" in out
