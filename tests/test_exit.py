"""A fresh interpreter that trains with a threaded Pipe exits cleanly, closed or not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The README's first example, ending right after a step: the rank threads were still freeing
# the step's tensors while the main thread finalised the interpreter (SIGABRT, "terminate
# called without an active exception") in about a third of runs before they were joined.
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from pipeline import Pipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256),
                          nn.GELU(), nn.Linear(256, 10))
    pipe = Pipe(model, balance=[3, 3], devices=["cpu", "cpu"], chunks=8, schedule="1f1b")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    for _ in range(2):
        pipe.step(x, y, nn.CrossEntropyLoss())
        optimizer.step()
        optimizer.zero_grad()
    pipe(x)
    if sys.argv[1] == "close":
        pipe.close()
""")


def _run(script: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # A hang guard, not an expected duration: on a loaded machine one run (two at a time, each
    # importing torch) can take a minute.
    return subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                          env=env, timeout=240, check=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_interpreter_exit_is_clean_many_times(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    modes = ["open", "close"] * 6
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda m: _run(script, m), modes))
    bad = [(m, r.returncode, r.stderr[-300:]) for m, r in zip(modes, runs, strict=True)
           if r.returncode != 0 or "terminate called" in r.stderr]
    assert not bad, f"{len(bad)} of {len(runs)} runs did not exit cleanly: {bad[:3]}"
