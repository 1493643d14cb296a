"""The documentation runs: README.md's and docs/*.md's Python blocks, commands and links.

Each ```python block is one test, named by file and line, run in a fresh temporary directory:
in this process as `__main__` (torch's thread count and random state, the schedule registry and
the current directory are restored after it), or under the launcher when marked. A marker is an
HTML comment on the line just before the fence, `<!-- docs-test: WORDS -->`:

- `continue`: the block runs as one script after the previous Python block of the same page
  (which shows on the page just above), for a page whose examples build on each other: where
  that block's own test just ran, in the namespace, directory and random state it left, else
  after running it (and the blocks it continues) first;
- `launch N`: a multi-process script, run as `python -m pipeline.launch --nproc N script.py`
  (gloo on loopback, N <= 4) in a subprocess, beside one busy process per core (tests/busy.py,
  as on a user's busy machine): every rank must exit 0, none abort at exit (the exit check of
  tests/test_exit.py, which `TEST_EXIT_REPEAT=N` repeats N times); marked `dist`;
- `script`: a script that starts processes itself (`pipeline.launch.spawn` needs its function
  importable), run as `python script.py` in a subprocess; marked `dist`;
- `gpu`: needs CUDA, skipped without it; marked `gpu`;
- `output` (on a plain ``` block whose first line is `$ pipeviz ...`): the command runs and
  what it prints must be the rest of the block, exactly.

The README's first example also runs under the launcher on two ranks, as the README says it
does. Shell blocks (```bash) are not run; every `pipeviz`, `python -m viz`,
`python -m benchmarks...` and `python -m pipeline.launch` line in them (and `$ ...` lines of
other blocks) is parsed by the command's own argparse parser, which is stopped before the
command runs. Every relative link (and image) of those pages points at a file that exists,
and at a heading of it when it names an anchor, and every repository path a page names in
backticks (`pipeline/comm/wire.py`, `tests/test_exit.py`) exists.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.busy import busy_cores, exit_repeat
from tests.limits import SPAWN_TIMEOUT

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARKERS = ("continue", "launch", "script", "gpu", "output")

_FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<words>[^>]*?)\s*-->\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts, its language, its text and its markers."""

    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    markers: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a markdown page (indented ones too, dedented)."""
    lines = page.read_text("utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, ticks = len(fence["indent"]), fence["ticks"]
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        words = tuple(marker["words"].split()) if marker else ()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            line = lines[j]
            body.append(line[indent:] if line.startswith(" " * indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page.name}:{i + 1}: a ``` block is never closed")
        found.append(Block(page, i + 1, fence["lang"], "\n".join(body) + "\n", words))
        i = j + 1
    return found


def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def _python_blocks() -> list[Block]:
    return [b for b in _all_blocks() if b.lang == "python"]


def _chain(block: Block) -> list[Block]:
    """The blocks `block` continues (markers `continue`), first to last, and `block`."""
    on_page = [b for b in _python_blocks() if b.page == block.page]
    index = next(i for i, b in enumerate(on_page) if b.line == block.line)
    start = index
    while "continue" in on_page[start].markers:
        if start == 0:
            raise AssertionError(f"{block.name}: `continue` on a page's first Python block")
        start -= 1
    return on_page[start:index + 1]


def script_of(block: Block) -> str:
    """The block's code, after the blocks it continues (markers `continue`)."""
    return "".join(f"# {b.name}\n{b.code}" for b in _chain(block))


def _param(block: Block) -> Any:
    marks: list[Any] = []
    if "gpu" in block.markers:
        marks.append(pytest.mark.gpu)
    if "launch" in block.markers or "script" in block.markers:
        marks.append(pytest.mark.dist)
    if "launch" in block.markers:  # a hang guard for every launch, beside busy processes
        marks.append(pytest.mark.timeout(SPAWN_TIMEOUT * exit_repeat() + 60))
    if "continue" in block.markers or _continued(block):
        # A chain's blocks on one of the suite's workers (tests/workers.py), in the page's
        # order: each then runs once, after the one before it, not the chain again.
        marks.append(pytest.mark.xdist_group(_chain(block)[0].name))
    return pytest.param(block, id=block.name, marks=marks)


def _launch_ranks(block: Block) -> int | None:
    words = block.markers
    if "launch" not in words:
        return None
    at = words.index("launch")
    count = words[at + 1] if at + 1 < len(words) else ""
    assert count.isdigit() and 1 <= int(count) <= 4, \
        f"{block.name}: write `launch N` with 1 <= N <= 4 ranks (got {words})"
    return int(count)


def _run_script(name: str, script: str, directory: Path, ranks: int | None) -> None:
    """Run `script` in a fresh interpreter in `directory`, under the launcher with `ranks`
    beside busy processes (`exit_repeat()` times, each in fresh interpreters)."""
    (directory / "script.py").write_text(script, "utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    launcher = ["-m", "pipeline.launch", "--nproc", str(ranks)] if ranks else []
    # A rank that aborts at exit (gloo's threads at the interpreter's finalisation) shows on
    # a loaded machine: the multi-process examples run beside one busy process per core.
    with busy_cores() if ranks else contextlib.nullcontext():
        for _ in range(exit_repeat() if ranks else 1):
            run = subprocess.run([sys.executable, *launcher, "script.py"], cwd=directory,
                                 env=env, capture_output=True, text=True,
                                 timeout=SPAWN_TIMEOUT)
            assert run.returncode == 0, f"{name} failed ({' '.join(launcher) or 'script'}):" \
                                        f"\n{run.stdout}\n{run.stderr}"
            assert "terminate called" not in run.stderr, \
                f"{name}: a process aborted at exit:\n{run.stderr}"


@contextlib.contextmanager
def _isolated(directory: Path) -> Iterator[None]:
    """Run in `directory`, then put back what a block may change for the tests after it."""
    from schedules import registry

    registry.available()  # the built-in generators load lazily: load them before the copy
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    generators = dict(registry._GENERATORS)
    cwd = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(cwd)
        registry._GENERATORS.clear()
        registry._GENERATORS.update(generators)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        gc.collect()  # Pipes the block made close their rank threads now


# What a block continued by the next one left (its namespace, directory and random state),
# by its name, from its own test to the next block's, which takes it: each block of a page's
# chain runs once, as the page reads, instead of the chain again for each block of it.
_LEFT: dict[str, tuple[dict[str, Any], Path, torch.Tensor]] = {}


@pytest.fixture(scope="module", autouse=True)
def _nothing_left() -> Iterator[None]:
    yield
    _LEFT.clear()  # a chain whose later blocks did not run: its Pipes close now
    gc.collect()


def _continued(block: Block) -> bool:
    on_page = [b for b in _python_blocks() if b.page == block.page]
    later = [b for b in on_page if b.line > block.line]
    return bool(later) and "continue" in later[0].markers


def _previous(block: Block) -> Block:
    return [b for b in _python_blocks() if b.page == block.page and b.line < block.line][-1]


@pytest.mark.parametrize("block", [_param(b) for b in _python_blocks()])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    unknown = [w for w in block.markers if w not in MARKERS and not w.isdigit()]
    assert not unknown, f"{block.name}: unknown docs-test marker(s) {unknown}; known: {MARKERS}"
    if "gpu" in block.markers and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    script = script_of(block)
    ranks = _launch_ranks(block)
    if ranks is not None or "script" in block.markers:
        _run_script(block.name, script, tmp_path, ranks)
        return
    left = _LEFT.pop(_previous(block).name, None) if "continue" in block.markers else None
    if left is not None:  # after the previous block, as it left things
        namespace, directory, rng = left
        code = compile(f"# {block.name}\n{block.code}", block.name, "exec")
    else:
        namespace, directory, rng = {"__name__": "__main__"}, tmp_path, None
        code = compile(script, block.name, "exec")
    with _isolated(directory), contextlib.redirect_stdout(io.StringIO()):
        if rng is not None:
            torch.set_rng_state(rng)
        exec(code, namespace)
        if _continued(block):
            _LEFT[block.name] = (namespace, directory, torch.get_rng_state())


@pytest.mark.dist
@pytest.mark.timeout(SPAWN_TIMEOUT * exit_repeat() + 60)  # beside busy processes, as above
def test_readme_example_runs_as_processes(tmp_path: Path) -> None:
    """The README says its first example runs as one process per rank, as written."""
    first = next(b for b in _python_blocks() if b.page.name == "README.md")
    _run_script(first.name, first.code, tmp_path, 2)


def _output_blocks() -> list[Block]:
    return [b for b in _all_blocks() if "output" in b.markers]


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in _output_blocks()])
def test_command_prints_what_the_page_shows(block: Block,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from viz.cli import main

    first, _, shown = block.code.partition("\n")
    assert first.startswith("$ pipeviz "), f"{block.name}: an output block starts `$ pipeviz`"
    assert main(shlex.split(first)[2:]) == 0
    assert capsys.readouterr().out == shown


# -- commands -----------------------------------------------------------------------------------

class _Parsed(BaseException):
    """Raised by the patched parse_args once the arguments parsed: the command never runs."""


def _entry(words: list[str]) -> tuple[Callable[[list[str]], Any], list[str]] | None:
    """The `main` a command line runs and its arguments, or None for other programs."""
    if words[:1] == ["pipeviz"]:
        return importlib.import_module("viz.cli").main, words[1:]
    if len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1] == "-m":
        module = words[2]
        if module == "viz":
            module = "viz.cli"
        elif module == "benchmarks":
            module = "benchmarks.cli"
        if module.split(".")[0] == "benchmarks" or module in ("viz.cli", "pipeline.launch"):
            return importlib.import_module(module).main, words[3:]
    return None


def command_lines(block: Block) -> list[str]:
    """The commands of a block: every line of a bash block, `$ ` lines of any other;
    backslash continuations joined, comments dropped."""
    out: list[str] = []
    pending = ""
    for raw in block.code.splitlines():
        line = raw.rstrip()
        if block.lang != "bash":
            if not (pending or line.startswith("$ ")):
                continue
            line = line.removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip():
            out.append(line)
    return out


def _commands() -> list[Any]:
    found = []
    for block in _all_blocks():
        for line in command_lines(block):
            words = shlex.split(line, comments=True)
            if words and _entry(words) is not None:
                found.append(pytest.param(line, id=f"{block.name}:{words[0]}"))
    return found


@pytest.mark.parametrize("line", _commands())
def test_command_line_parses(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _entry(shlex.split(line, comments=True))
    assert entry is not None
    main, argv = entry
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(parse(self, *args, **kwargs))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            status = main(argv)
    except _Parsed:
        return
    except SystemExit as exc:
        status = exc.code
    pytest.fail(f"`{line}` does not parse (status {status}): {stderr.getvalue().strip()}")


def test_command_lines_are_found() -> None:
    """The check above sees the pages' commands (a parser change would not go unnoticed)."""
    lines = [p.values[0] for p in _commands()]
    assert any(line.startswith("pipeviz compare") for line in lines)
    assert any(line.startswith("pipeviz plan") for line in lines)
    assert any(line.startswith("python -m benchmarks --suite") for line in lines)


def test_a_bad_command_line_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        test_command_line_parses("pipeviz 1f1b --ranks zero", monkeypatch)
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        test_command_line_parses("python -m benchmarks --suite nosuch", monkeypatch)


# -- links --------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in page.read_text("utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """Relative link targets of a page outside code, with their line numbers."""
    out = []
    in_fence = False
    for number, line in enumerate(page.read_text("utf-8").splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        for m in _LINK.finditer(prose):
            target = m["target"]
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                out.append((number, target))
    return out


def _links() -> list[Any]:
    return [pytest.param(page, number, target, id=f"{page.relative_to(ROOT).as_posix()}:{number}")
            for page in PAGES for number, target in links(page)]


@pytest.mark.parametrize(("page", "number", "target"), _links())
def test_link_resolves(page: Path, number: int, target: str) -> None:
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    name = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
    where = f"{page.relative_to(ROOT)}:{number}: {target}"
    assert file.exists(), f"{where}: no such file {name}"
    if anchor:
        assert file.suffix == ".md", f"{where}: an anchor into a file that is not markdown"
        assert anchor in anchors(file), f"{where}: no heading #{anchor} in {name}"


def test_links_are_found() -> None:
    """The pages link to one another: the checker is not looking at nothing."""
    targets = {t for _, _, t in (p.values for p in _links())}
    assert any(t.startswith("docs/") for t in targets)
    assert any("#" in t for t in targets)


def test_a_broken_link_is_caught() -> None:
    page = ROOT / "docs" / "index.md"
    with pytest.raises(AssertionError, match="no such file"):
        test_link_resolves(page, 1, "no-such-page.md")
    with pytest.raises(AssertionError, match="no heading"):
        test_link_resolves(page, 1, "pipe.md#no-such-heading")
    with pytest.raises(AssertionError, match="no heading"):
        test_link_resolves(page, 1, "program.md#whatever")  # no page is exempt
    test_link_resolves(page, 1, "program.md#the-actions")


_PATH = re.compile(r"`((?:benchmarks|docs|pipeline|schedules|tests|viz)/[\w./-]*)`")


def _named_paths() -> list[Any]:
    return [pytest.param(page, m[1], id=f"{page.relative_to(ROOT).as_posix()}:{m[1]}")
            for page in PAGES for m in _PATH.finditer(page.read_text("utf-8"))]


@pytest.mark.parametrize(("page", "path"), _named_paths())
def test_named_path_exists(page: Path, path: str) -> None:
    assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} names {path}, which does not exist"


def test_slug_follows_github() -> None:
    assert slug("Pipe: train an `nn.Sequential` across devices") == \
        "pipe-train-an-nnsequential-across-devices"
    assert slug("Pipeline x data parallelism on a `DeviceMesh`") == \
        "pipeline-x-data-parallelism-on-a-devicemesh"
    assert slug("CSV: schedules both ways with torch.distributed.pipelining") == \
        "csv-schedules-both-ways-with-torchdistributedpipelining"
    assert slug("Schedules (`schedules/`, no torch needed)") == \
        "schedules-schedules-no-torch-needed"


def test_blocks_are_found_with_known_markers() -> None:
    """Blocks are found on the README and the docs pages, markers are only the known ones."""
    found = _python_blocks()
    assert any(b.page.name == "README.md" for b in found)
    assert len({b.page for b in found}) > 5
    for b in found:
        words = [w for w in b.markers if not w.isdigit()]
        assert set(words) <= set(MARKERS), f"{b.name}: unknown marker in {b.markers}"
