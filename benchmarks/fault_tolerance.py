"""Measure a killed rank under torchft: the survivors' pause and losses, the heal, throughput.

    python -m benchmarks.fault_tolerance [--steps 1000] [--kill-at 100] [--point backward]

Runs `python -m pipeline.launch --replicas 2 --nproc 2` on tests/pipeline/ft_train.py
(2 replicas x 2 stages of four 16-wide linear layers, AdamW, CPU, gloo), SIGKILLs replica 1's
rank 1 at `--point` of step `--kill-at`, and reads the ranks' logs (docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["main", "measure"]

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "pipeline" / "ft_train.py"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.open()]


def _rate(entries: list[dict[str, Any]]) -> float:
    """Committed steps per second over `entries` (time between the first and the last)."""
    done = [e for e in entries if e["committed"]]
    if len(done) < 2:
        return float("nan")
    return (len(done) - 1) / float(done[-1]["t"] - done[0]["t"])


def measure(steps: int, kill_at: int, point: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", "2", "--nproc", "2",
               str(SCRIPT), tmp, str(steps), f"1:1:{kill_at}:{point}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise SystemExit(f"launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
        killed = float((out / "killed").read_text())
        survivor = _lines(out / "log_0_0.jsonl")
        restarted = _lines(out / "start_1_1.jsonl")[-1]  # the second start: the heal
        before = [e for e in survivor if e["t"] < killed and e["step"] >= 10]  # warm
        after_kill = [e for e in survivor if e["t"] > killed]
        alone = [e for e in after_kill if e["participants"] == 1]
        rejoined = [e for e in after_kill if e["participants"] == 2 and e["committed"]]
        first_commit = next(e for e in after_kill if e["committed"])
        committed = [e["step"] for e in survivor if e["committed"]]
        healed_at = restarted["built"] + restarted["quorum_s"]
        return {
            "kill_to_next_commit_s": first_commit["t"] - killed,
            "steps_retried": sum(not e["committed"] for e in survivor),
            "committed_steps_lost": len(set(range(committed[-1] + 1)) - set(committed)),
            "kill_to_healed_s": healed_at - killed,
            "heal_quorum_s": restarted["quorum_s"],
            "healed_at_step": restarted["step"],
            "steps_per_s_before": _rate(before),
            "steps_per_s_alone": _rate(alone),
            "steps_per_s_after": _rate(rejoined),
            "final_step": committed[-1] + 1,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_tolerance",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kill-at", type=int, default=100)
    parser.add_argument("--point", choices=["forward", "backward", "step"], default="backward")
    parser.add_argument("--runs", type=int, default=1)
    ns = parser.parse_args(argv)
    for run in range(ns.runs):
        result = measure(ns.steps, ns.kill_at, ns.point)
        print(f"run {run}: " + ", ".join(f"{k}={v:.3g}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
