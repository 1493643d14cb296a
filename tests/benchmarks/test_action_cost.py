"""benchmarks.action_cost: a tiny run end to end (nothing timed is asserted)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from benchmarks.action_cost import main


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    # measure() sets one intra-op thread; give the rest of the session its own back.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_tiny_run_prints_a_row_per_schedule_and_count(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert main(["--microbatches", "2", "--schedules", "interleaved,zb-v", "--steps", "2",
                 "--warmup", "1", "--profiled", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| interleaved", "| zb-v"))]
    # 2 stages x 2 micro-batches: F and B of each (interleaved), F, I and W (zb-v)
    assert [r.split(" | ")[:3] for r in rows] == [["| interleaved", "2", "8"],
                                                  ["| zb-v", "2", "12"]]
    for row in rows:
        calls, bare = (float(v) for v in row.split(" | ")[7:9])
        assert calls > bare > 0  # the Pipe's step calls the bare layers and more
