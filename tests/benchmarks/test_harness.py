"""benchmarks.harness without processes: the alternation, variant lists, merging, the steps."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.harness import (
    Measured,
    Variant,
    _bound_work,
    _chunks,
    _plain,
    alternate,
    bound_key,
    merge_ranks,
    resolve_balances,
    roles,
    variant_keys,
)
from tests.benchmarks import fakes

ROOT = Path(__file__).resolve().parents[2]


def test_alternate_rotates_skips_warmup_and_marks_who_sat_out() -> None:
    calls: list[str] = []
    variants = [Variant("a", lambda: calls.append("a")), Variant("b", lambda: calls.append("b")),
                Variant("c", None), Variant("d", lambda: calls.append("d"),
                                                collect=lambda start: [(0, "0F0", start, start)])]
    prepared: list[int] = []
    taking: list[bool] = []
    settled: list[int] = []
    out = alternate(variants, warmup=1, repeats=2, prepare=lambda: prepared.append(1),
                    barrier=taking.append, sync=lambda: None,
                    settle=lambda: settled.append(len(calls)))
    # Round r starts at variant r: a b d | b d a | d a b ("c" never runs here).
    assert calls == ["a", "b", "d", "b", "d", "a", "d", "a", "b"]
    assert len(prepared) == len(calls)
    rounds = ["a b c d", "b c d a", "c d a b"]  # every process passes every barrier
    assert taking == [v != "c" for r in rounds for v in r.split()]
    assert settled == list(range(1, len(calls) + 1))  # after each step this process took
    assert [len(v) for v in out.values()] == [2, 2, 2, 2]  # warm-up round not recorded
    assert out["c"] == [None, None]
    a0 = out["a"][0]
    assert a0 is not None and a0[0] <= a0[1] and a0[2] is None
    d0 = out["d"][0]
    assert d0 is not None and d0[2] == [(0, "0F0", d0[0], d0[0])]


def test_alternate_counts_each_steps_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each recorded step gets the CPU seconds this process used in it (contention.py); a
    step it sat out gets None."""
    used = iter(float(i) for i in range(100))
    monkeypatch.setattr("pipeline.planner.contention.cpu_seconds", lambda: next(used) ** 2)
    cpu: dict[str, list[float | None]] = {}
    alternate([Variant("a", lambda: None), Variant("b", None)], warmup=0, repeats=2,
              prepare=lambda: None, barrier=lambda taking: None, sync=lambda: None,
              settle=lambda: None, cpu=cpu)
    # Readings 0,1 | 2,3 | 4,5 | 6,7 around the steps a b | b a: squares' differences.
    assert cpu == {"a": [1.0, 13.0], "b": [None, None]}


def test_roles_and_variant_keys() -> None:
    g = fakes.group(2, schedules=("gpipe", "1f1b", "2bw"))
    assert roles(g) == ["pipe", "pipe", "plain:1", "plain:all", "threads"]
    keys, skipped = variant_keys(g, 1)
    assert keys[:2] == ["processes/ours/gpipe", "processes/torch/gpipe"]
    assert "processes/torch/1f1b" not in keys  # torch's 1F1B needs m >= p
    assert "m=1 < p=2" in skipped["processes/torch/1f1b"]
    assert "no 2bw" in skipped["processes/torch/2bw"]
    assert "threads/ours/2bw" in keys and not any(k.startswith("threads/torch") for k in keys)
    assert bound_key("threads", (2, 3)) in keys
    assert keys[-2:] == ["plain/1", "plain/all"]
    only_threads = fakes.group(2, transports=("threads",))
    assert roles(only_threads) == ["plain:1", "plain:all", "threads"]


def test_merge_ranks_spans_from_first_start_to_last_end() -> None:
    a = {4: Measured({"x": [(1.0, 2.0, [(0, "0F0", 1.1, 1.2)]), None], "y": [None, None]},
                     {"processes/ours/1f1b": {"peak_stashed_bytes": [10],
                                              "peak_stashed_microbatches": [2]}}, {"t": "why"})}
    b = {4: Measured({"x": [(0.9, 1.5, [(1, "1F0", 1.3, 1.4)]), None], "y": [None, None]},
                     {"processes/ours/1f1b": {"peak_stashed_bytes": [20],
                                              "peak_stashed_microbatches": [1]}}, {"t": "why"})}
    a[4].cpu.update({"x": [0.5, None], "y": [None, None]})
    b[4].cpu.update({"x": [0.25, None], "y": [None, None]})
    merged = merge_ranks([a, b])[4]
    assert merged.cpu == {"x": [0.75, None], "y": [None, None]}  # every process's CPU time
    assert merged.samples["x"][0] == (0.9, 2.0, [(0, "0F0", 1.1, 1.2), (1, "1F0", 1.3, 1.4)])
    assert merged.samples["x"][1] is None and merged.samples["y"] == [None, None]
    assert merged.memory == {"processes/ours/1f1b": {"peak_stashed_bytes": [10, 20],
                                                     "peak_stashed_microbatches": [2, 1]}}
    assert merged.skipped == {"t": "why"}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def test_plain_step_accumulates_the_full_batch_gradient() -> None:
    model = _model()
    x, y = torch.randn(10, 4), torch.randn(10, 2)
    _plain(model, _chunks(x, y, 3), nn.MSELoss())()  # uneven: 4, 3, 3 rows
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    nn.MSELoss()(model(x), y).backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


def test_bound_work_runs_each_ranks_stages_and_touches_only_their_weights() -> None:
    model = _model()
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    chunks = _chunks(x, y, 2)
    rank1 = _bound_work(model, [2, 3], [1], chunks, nn.MSELoss(), torch.device("cpu"))
    rank1()
    grads = [p.grad is not None for p in model.parameters()]
    assert grads == [False, False, True, True, True, True]  # layers 0 and 2/4 own them
    model.zero_grad(set_to_none=True)
    rank0 = _bound_work(model, [2, 3], [0], chunks, nn.MSELoss(), torch.device("cpu"))
    rank0()
    assert [p.grad is not None for p in model.parameters()] == [True, True, False, False,
                                                               False, False]


def test_resolve_balances_logs_them_at_info(caplog: pytest.LogCaptureFixture) -> None:
    group = fakes.group(2, schedules=("1f1b",))
    with caplog.at_level(logging.INFO, logger="benchmarks"):
        resolved = resolve_balances(group)
    assert resolved.balances["1f1b"] == (2, 3)  # the tiny model by params: 5 layers
    assert [r.getMessage() for r in caplog.records if r.name == "benchmarks.harness"] == [
        "group tiny/params/p2: balance by params: {'1f1b': [2, 3]}"]


def test_benchmarks_log_nothing_unless_configured() -> None:
    """Library style: a NullHandler, no output, even for warnings (no last-resort printing)."""
    code = ("import logging, benchmarks.harness as h; from tests.benchmarks import fakes; "
            "h.resolve_balances(fakes.group(2)); logging.getLogger('benchmarks.cli')"
            ".warning('loud')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == proc.stderr == ""
