"""Measure a killed rank under torchft (the survivors' pause and losses, the heal, throughput)
beside the same job restarted from its last sharded checkpoint.

    python -m benchmarks.fault_tolerance [--steps 1000] [--kill-at 100] [--point backward]
                                         [--checkpoint-every 40] [--runs 1]

Runs tests/pipeline/ft_train.py (2 stages of four 16-wide linear layers, AdamW, CPU, gloo)
twice under `python -m pipeline.launch`: as 2 replica groups x 2 ranks under torchft,
SIGKILLing replica 1's rank 1 at `--point` of step `--kill-at`; and as the baseline, one
group of 2 ranks without torchft saving a sharded checkpoint (pipe.save) every
`--checkpoint-every` steps, killed at the same step (after its backward) and restarted by the
launcher, resuming from the last checkpoint (pipe.load). Reads the ranks' logs
(docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["main", "measure", "measure_checkpoint"]

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "pipeline" / "ft_train.py"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.open()]


def _rate(entries: list[dict[str, Any]]) -> float:
    """Committed steps per second over `entries` (time between the first and the last)."""
    done = [e for e in entries if e["committed"]]
    if len(done) < 2:
        return float("nan")
    return (len(done) - 1) / float(done[-1]["t"] - done[0]["t"])


def _launch(out: Path, replicas: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", str(replicas), "--nproc",
           "2", "--max-restarts", "1", str(SCRIPT), str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({done.returncode}):\n{done.stderr[-3000:]}")


def measure(steps: int, kill_at: int, point: str) -> dict[str, float]:
    """2 replica groups under torchft, replica 1's rank 1 killed at `point` of `kill_at`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _launch(out, 2, str(steps), "--kill", f"1:1:{kill_at}:{point}")
        killed = float(json.loads((out / "killed_0").read_text())["t"])
        survivor = _lines(out / "log_0_0.jsonl")
        restarted = _lines(out / "start_1_1.jsonl")[-1]  # the second start: the heal
        before = [e for e in survivor if e["t"] < killed and e["step"] >= 10]  # warm
        after_kill = [e for e in survivor if e["t"] > killed]
        alone = [e for e in after_kill if len(e["members"]) == 1]
        rejoined = [e for e in after_kill if len(e["members"]) == 2 and e["committed"]]
        first_commit = next(e for e in after_kill if e["committed"])
        committed = [e["step"] for e in survivor if e["committed"]]
        return {
            "kill_to_next_commit_s": first_commit["t"] - killed,
            "steps_retried": sum(not e["committed"] for e in survivor),
            "committed_steps_lost": len(set(range(committed[-1] + 1)) - set(committed)),
            "kill_to_healed_s": restarted["built"] + restarted["resume_s"] - killed,
            "heal_s": restarted["resume_s"],
            "healed_at_step": restarted["step"],
            "steps_per_s_before": _rate(before),
            "steps_per_s_alone": _rate(alone),
            "steps_per_s_after": _rate(rejoined),
            "final_step": committed[-1] + 1,
        }


def measure_checkpoint(steps: int, kill_at: int, every: int,
                       keep: Path | None = None) -> dict[str, float]:
    """The baseline: one group, a checkpoint every `every` steps, killed at `kill_at` (its
    files kept in `keep` if given)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = keep if keep is not None else Path(tmp)
        _launch(out, 1, str(steps), "--kill", f"0:1:{kill_at}:step",
                "--checkpoint-every", str(every))
        killed = float(json.loads((out / "killed_0").read_text())["t"])
        log = _lines(out / "log_0_0.jsonl")
        restarted = _lines(out / "start_0_1.jsonl")[-1]  # the second start: the load
        before = [e for e in log if e["t"] < killed and e["step"] >= 10]
        # The restarted job's steps (rank 0 of the killed one may log its last after the kill)
        after_kill = [e for e in log if e["t"] > restarted["built"]]
        caught_up = next(e for e in after_kill if e["step"] == kill_at)
        saves = [e["saved_s"] for e in log if "saved_s" in e]
        return {
            "kill_to_next_step_s": after_kill[0]["t"] - killed,
            "steps_redone": kill_at - after_kill[0]["step"],
            "kill_to_caught_up_s": caught_up["t"] - killed,
            "kill_to_resumed_s": restarted["built"] + restarted["resume_s"] - killed,
            "load_s": restarted["resume_s"],
            "save_s_mean": sum(saves) / len(saves),
            "steps_per_s_before": _rate(before),
            "steps_per_s_after": _rate([e for e in after_kill if e["step"] > kill_at]),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fault_tolerance",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--kill-at", type=int, default=100)
    parser.add_argument("--point", default="backward",
                        choices=["forward", "backward", "step", "allreduce", "optimizer"])
    parser.add_argument("--checkpoint-every", type=int, default=40,
                        help="the baseline's checkpoint interval in steps (0: no baseline)")
    parser.add_argument("--runs", type=int, default=1)
    ns = parser.parse_args(argv)
    for run in range(ns.runs):
        result = measure(ns.steps, ns.kill_at, ns.point)
        print(f"run {run} torchft: " + ", ".join(f"{k}={v:.3g}" for k, v in result.items()))
        if ns.checkpoint_every:
            base = measure_checkpoint(ns.steps, ns.kill_at, ns.checkpoint_every)
            print(f"run {run} checkpoint: " + ", ".join(f"{k}={v:.3g}"
                                                        for k, v in base.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
