"""benchmarks.demo: the tokenizer, the batches, and a short run end to end."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.demo import CharTokenizer, _windows, load_text, main

# A small model and few steps: the whole run takes a few seconds.
_SMALL = ["--steps", "4", "--batch", "4", "--chunks", "2", "--context", "16", "--width", "32",
          "--depth", "2", "--heads", "2", "--sample", "8"]


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    # main() sets one intra-op thread (one per rank); give the rest of the session its own back.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_shipped_text_and_its_tokenizer_round_trip() -> None:
    text = load_text()
    assert len(text) > 100_000 and text.startswith("First Citizen:")
    tokenizer = CharTokenizer(text)
    assert tokenizer.vocab == len(set(text))
    ids = tokenizer.encode(text[:500])
    assert ids.dtype == torch.int64 and tokenizer.decode(ids) == text[:500]


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
