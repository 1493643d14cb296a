"""benchmarks.anatomy: a step's parts, measured from what the runtime records, add up to it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import viz
from benchmarks import anatomy
from benchmarks.anatomy_parts import (
    PARTS,
    PATH_PARTS,
    RankRecord,
    critical_path,
    excess,
    ideal_step,
    mean_anatomy,
    split_step,
    timeline_of,
)
from benchmarks.anatomy_report import render, summarize_rounds, trimmed
from pipeline import Pipe
from schedules import Timeline

# The parts are measured separately and add up only if the records tile the step without
# overlap: on the same clock, to float rounding.
TOL = 1e-9


def _two_ranks() -> list[RankRecord]:
    """Two ranks of one step with known parts (milliseconds as seconds, for reading).

    Rank 0: 0F0 10-30, SEND_F 30-32, waits for B0:0 32-48, 0B0 50-70, then the step's phases.
    Rank 1: waits for F1:0 12-35 (rank 0 computed until 30, sent until 32), 1F0 35-45,
    1B0 45-47 (SEND_B 47-48), a REDUCE_GRAD 48-49.
    """
    phases0 = {"begin": (5.0, 6.0), "finish": (90.0, 92.0), "share": (92.0, 95.0)}
    r0 = RankRecord(0, (0.0, 100.0), (10.0, 90.0),
                    (("0F0", 10.0, 30.0), ("0B0", 50.0, 70.0)),
                    (("0SEND_F0", 30.0, 32.0), ("0RECV_B0", 70.0, 72.0)),
                    ((("B", 0, 0), 32.0, 48.0),), phases0)
    r1 = RankRecord(1, (1.0, 99.0), (11.0, 60.0),
                    (("1F0", 35.0, 45.0), ("1B0", 45.0, 47.0), ("1REDUCE_GRAD0", 48.0, 49.0)),
                    (("1SEND_B0", 47.0, 48.0),),
                    ((("F", 1, 0), 12.0, 35.0),), {"share": (60.0, 61.0)})
    return [r0, r1]


def test_a_synthetic_step_splits_into_its_known_parts() -> None:
    a0, a1 = split_step(_two_ranks())
    assert a0.step == a1.step == 100.0
    assert a0.parts == pytest.approx({"compute": 40.0, "runtime": 24.0, "wait": 16.0,
                                      "sync": 5.0, "outside": 15.0})
    assert a0.detail["runtime"] == pytest.approx({"SEND actions": 2.0,
                                                  "RECV actions (posting)": 2.0,
                                                  "between actions": 20.0})
    assert a0.detail["outside"] == pytest.approx({"before the first action": 9.0,
                                                  "receives posted (begin)": 1.0,
                                                  "after the last action": 5.0})
    assert a0.detail["sync"] == pytest.approx({"sends complete (end of step)": 2.0,
                                               "loss to every rank": 3.0})
    # Rank 1 produced B0:0 at 47 and sent it by 48: rank 0's wait (32-48) was for its compute.
    assert a0.detail["wait"] == pytest.approx({"peer computing": 15.0, "peer sending": 1.0})
    assert a0.messages == {"B0:0": 16.0}
    # Rank 1 waited 12-35 for F1:0: rank 0 computed until 30, sent until 32, then in transit.
    assert a1.detail["wait"] == pytest.approx({"peer computing": 18.0, "peer sending": 2.0,
                                               "in transit": 3.0})
    assert a1.parts == pytest.approx({"compute": 12.0, "runtime": 11.0 + 1.0 + 1.0,
                                      "wait": 23.0, "sync": 2.0, "outside": 11.0 + 40.0 - 1.0})
    # Rank 1 was called at 1 and returned at 99 of the step's 0-100.
    assert a1.detail["outside"] == pytest.approx({"before its call": 1.0,
                                                  "before the first action": 10.0,
                                                  "after the last action": 38.0,
                                                  "after its return": 1.0})
    for a in (a0, a1):
        assert a.total == pytest.approx(a.step, abs=TOL)
        assert a.overlap == 0.0
        assert all(v >= 0 for v in a.parts.values())


def test_the_critical_path_crosses_ranks_where_a_rank_waited() -> None:
    # Back from rank 0's return (100): its phases and gaps, 0B0, the wait for B0:0 (rank 1
    # sent it at 48: no transit) -> rank 1's SEND_B0, 1B0, 1F0, the wait for F1:0 (sent at
    # 32: 3 in transit) -> rank 0's SEND_F0, 0F0, and the time before it.
    path = critical_path(_two_ranks())
    assert path == pytest.approx({"compute": 20.0 + 2.0 + 10.0 + 20.0,
                                  "runtime": 18.0 + 2.0 + 2.0 + 1.0 + 2.0, "transit": 3.0,
                                  "sync": 5.0, "outside": 5.0 + 4.0 + 1.0 + 5.0})
    assert sum(path.values()) == pytest.approx(100.0, abs=TOL)


def test_time_two_records_claim_is_counted_once_and_reported() -> None:
    r0 = _two_ranks()[0]
    clash = RankRecord(0, r0.call, r0.run, (*r0.actions, ("0W0", 60.0, 75.0)), r0.comm,
                       r0.waits, r0.phases)
    (a,) = split_step([clash])
    assert a.total == pytest.approx(a.step, abs=TOL)
    assert a.overlap == pytest.approx(10.0 + 2.0)  # 60-70 under 0B0, 70-72 under RECV_B
    assert a.detail["compute"]["weight grad"] == pytest.approx(5.0)


def test_records_survive_json() -> None:
    for r in _two_ranks():
        assert RankRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_the_ideal_and_the_step_beyond_it() -> None:
    assert ideal_step([80.0, 100.0], 16, 2) == pytest.approx(100.0 * 17 / 16)
    assert ideal_step([100.0], 8, 4, stages_per_rank=2) == pytest.approx(100.0 * (1 + 3 / 16))
    a0, _ = split_step(_two_ranks())
    parts = excess(a0, alone=30.0, ideal=60.0)
    assert parts["compute"] == pytest.approx(10.0) and parts["wait"] == pytest.approx(-14.0)
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"])
    assert parts["total"] == pytest.approx(40.0)
    # The step's time outside a rank's own call is idle time, as its waits are.
    _, a1 = split_step(_two_ranks())
    parts = excess(a1, alone=12.0, ideal=60.0)
    assert parts["wait"] == pytest.approx(23.0 + 2.0 - 48.0)
    assert parts["outside"] == pytest.approx(48.0)
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"])


def test_means_over_steps_still_add_up() -> None:
    a0, a1 = split_step(_two_ranks())
    mean = mean_anatomy([a0, a1])
    assert mean.total == pytest.approx(mean.step)
    assert trimmed([5.0, 1.0, 3.0, 9.0, 4.0, 2.0, 7.0, 8.0]) == [0, 2, 4, 6]
    assert trimmed([2.0, 1.0]) == [0, 1]


def _tiny_pipe(m: int) -> tuple[Pipe, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)])
    return (Pipe(model, [2, 2], chunks=m, devices=["cpu", "cpu"], checkpoint="never"),
            torch.randn(16, 32), torch.randn(16, 32))


def test_a_real_step_adds_up_and_every_part_is_measured() -> None:
    pipe, x, y = _tiny_pipe(4)
    for _ in range(3):
        start = time.perf_counter()
        pipe.step(x, y, nn.MSELoss())
        call = (start, time.perf_counter())
    records = anatomy.records_of(pipe, call)
    pipe.close()
    assert [r.rank for r in records] == [0, 1]
    for a, rec in zip(split_step(records), records, strict=True):
        # The parts tile the step: each >= 0, nothing claimed twice, and they add up.
        assert a.step == pytest.approx(call[1] - call[0], abs=TOL)
        assert a.total == pytest.approx(a.step, abs=TOL)
        assert all(a.parts[p] >= 0 for p in PARTS)
        assert a.overlap == pytest.approx(0.0, abs=TOL)
        # Nothing recorded was cut: compute is the timeline's, waits are the runtime's.
        computed = sum(e - s for _, s, e in rec.actions)
        assert a.parts["compute"] == pytest.approx(computed, abs=TOL)
        assert a.parts["wait"] == pytest.approx(sum(e - s for _, s, e in rec.waits), abs=TOL)
        assert sum(a.messages.values()) == pytest.approx(a.parts["wait"], abs=TOL)
        assert rec.call[0] <= rec.run[0] <= rec.run[1] <= rec.call[1]
    path = critical_path(records)
    assert sum(path.values()) == pytest.approx(call[1] - call[0], abs=TOL)
    assert all(path[p] >= 0 for p in PATH_PARTS) and path["compute"] > 0
    # Rank 1 waits for each micro-batch's activations, rank 0 for each one's gradients.
    assert {w[0][0] for w in records[1].waits} == {"F"}
    assert {w[0][0] for w in records[0].waits} == {"B"}
    timeline = timeline_of(records, {"schedule": "1f1b", "num_ranks": 2, "num_stages": 2,
                                     "num_microbatches": 4})
    assert len(timeline.events) == 16 and min(e.start for e in timeline.events) >= 0


def test_the_command_runs_and_writes_what_pipeviz_draws(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert anatomy.main(["--model", "tiny", "--transport", "threads", "--microbatches", "2",
                         "--steps", "2", "--warmup", "0", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "parts added up" in printed and "ours / ideal" in printed
    results = json.loads((tmp_path / "results.json").read_text())
    (summary,) = results["summaries"]
    for rank in summary["anatomy"]:
        assert sum(rank["parts_s"].values()) == pytest.approx(rank["step_s"], abs=TOL)
    measured = tmp_path / "timelines" / "m2-measured.json"
    assert Timeline.from_json(measured.read_text()).unit == "s"
    predicted = Timeline.from_json((tmp_path / "timelines" / "m2-predicted.json").read_text())
    assert predicted.meta["predicted"] and predicted.unit == "s"
    svg = (tmp_path / "timelines" / "m2-measured-vs-predicted.svg").read_text()
    assert "measured" in svg and "predicted" in svg


def test_rounds_summarize_into_a_table() -> None:
    rounds = [(_two_ranks(), [30.0, 20.0]), (_two_ranks(), [32.0, 22.0])]
    s = summarize_rounds(rounds, 1)
    assert s.ideal == pytest.approx(31.0 * 2) and s.ratio == pytest.approx(100.0 / 62.0)
    text = render(s, "synthetic")
    assert "B0:0 16000.0" in text and "| parts added up | 100000.0 | 100000.0 |" in text


def test_pipeviz_draws_a_measured_step_over_its_prediction(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    pipe, x, y = _tiny_pipe(4)
    pipe.step(x, y, nn.MSELoss())
    path = tmp_path / "step.json"
    path.write_text(pipe.last_timeline().to_json())
    pipe.close()
    assert viz.main([str(path), "--predicted", "--width", "80"]) == 0
    text = capsys.readouterr().out
    assert "1f1b, measured" in text and "1f1b, predicted" in text
    assert viz.main([str(path), "--predicted", "-o", str(tmp_path / "both.svg")]) == 0
    assert "1f1b, predicted" in (tmp_path / "both.svg").read_text()
    assert viz.main([str(path), "--predicted", "--format", "json",
                     "-o", str(tmp_path / "p.json")]) == 0
    guess = Timeline.from_json((tmp_path / "p.json").read_text())
    assert guess.meta["predicted"] and len(guess.events) == 16
    assert viz.main(["1f1b", "--predicted"]) == 2  # a schedule has no measured step
    assert "one measured timeline" in capsys.readouterr().err
