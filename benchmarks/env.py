"""The environment a result was measured in: versions, CPU or GPU, threads, git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = ["cpu_name", "environment", "git_commit"]

_ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(root: Path = _ROOT) -> str | None:
    """HEAD's hash, with "+dirty" when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def environment(device: str = "cpu") -> dict[str, Any]:
    """What a reader needs to compare a result with theirs."""
    gpu = None
    if torch.cuda.is_available():
        gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "gpu": gpu,
        "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "num_cpus": os.cpu_count(),
        "threads_per_rank": 1,
        "plain_all_threads": os.cpu_count(),
        "torch_default_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
    }
