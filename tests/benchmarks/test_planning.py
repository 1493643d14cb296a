"""benchmarks.planning: the planner against every configuration of its space, measured alike."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import schedules
from benchmarks.planning.calibrate import calibrate, fit_line, halves
from benchmarks.planning.held_out import time_model_what_if
from benchmarks.planning.record import config_rows, error_sources, results_for, round_seconds
from benchmarks.planning.report import noise_floor, report
from benchmarks.planning.rounds import Measured, Turn, merge, orders, run_rounds
from benchmarks.planning.run import main, profile_rows
from benchmarks.planning.space import (
    Config,
    Entry,
    allreduce_seconds,
    balance_neighbours,
    build_space,
    dedupe,
    from_candidate,
    index_of,
    predictor,
)
from benchmarks.planning.stats import (
    Standing,
    anatomy,
    bootstrap,
    decompose,
    error_summary,
    spearman,
    standing,
)
from pipeline.planner import Link, Plan, PlanError, TimeModel, plan, predict
from tests.benchmarks import fakes


def _config(schedule: str = "1f1b", chunks: int = 2, balance: tuple[int, ...] = (2, 3),
            checkpoint: str = "never") -> Config:
    return Config(schedule, (), chunks, checkpoint, balance, 1, 2)


def _plan(budget: float | None = None) -> Plan:
    """A plan of a 5-layer model on 2 ranks from a synthetic profile: nothing is timed."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    x = torch.zeros(16, 4)
    return plan(model, x, x, nn.MSELoss(), ranks=2, memory_per_rank=budget,
                profile=fakes.planning_profile(), link=Link.free(), contention=1.0,
                chunks=[1, 2, 4])


# -- the protocol: every configuration alike -----------------------------------------------------

def test_each_round_is_a_fresh_shuffle_of_every_configuration() -> None:
    turns = orders(30, 5, seed=3)
    assert all(sorted(o) == list(range(30)) for o in turns)
    assert len({tuple(o) for o in turns}) == 5  # a new order every round
    assert turns == orders(30, 5, seed=3)  # every process computes the same orders
    assert turns != orders(30, 5, seed=4)


def test_every_configuration_takes_one_turn_per_round_the_plan_and_default_too() -> None:
    configs = [_config(chunks=m, balance=b) for m in (1, 2, 4) for b in ((2, 3), (3, 2))]
    calls: list[tuple[str, bool]] = []
    turns = orders(len(configs), 4, seed=0)
    got = run_rounds(configs, turns, fakes.planning_turn(lambda c, k: 0.01, calls))
    n = len(configs)
    for r in range(4):  # each round: every configuration once, in that round's order
        assert [k for k, _ in calls[r * n:(r + 1) * n]] == [configs[i].key for i in turns[r]]
    # Memory is counted in the first round, for every configuration alike, and only then.
    assert [memory for _, memory in calls] == [True] * n + [False] * (3 * n)
    assert [len(row) for row in got] == [n] * 4
    assert all(got[r][i].steps for r in range(4) for i in range(n))


def test_a_round_that_leaves_out_or_repeats_a_configuration_is_refused() -> None:
    configs = [_config(chunks=m) for m in (1, 2, 4)]
    turn = fakes.planning_turn(lambda c, k: 0.01, [])
    with pytest.raises(ValueError, match="one turn per configuration"):
        run_rounds(configs, [[0, 1, 1]], turn)


def test_the_plan_is_ranked_by_its_own_measurements_like_any_other() -> None:
    """The plan gets no pass into a final round: slower than two others in every round (the
    machine drifting by half over the rounds), it ranks third."""
    configs = [_config(chunks=m) for m in (1, 2, 4, 8)]
    planned = configs[2]
    base = {configs[0].key: 0.010, configs[1].key: 0.012, planned.key: 0.013,
            configs[3].key: 0.020}
    calls: list[tuple[str, bool]] = []
    turns = orders(len(configs), 5, seed=2)
    raw = run_rounds(configs, turns,
                     fakes.planning_turn(lambda c, k: base[c.key] * (1 + 0.1 * k), calls))
    times = round_seconds(merge([raw], configs))
    assert [len(t) for t in times] == [5] * 4
    s = standing(times, [True] * 4, 2)
    assert s.rank == 3 and s.best == 0
    assert s.regret == pytest.approx(0.3)  # drift falls on all alike: 0.013 / 0.010


# -- rank, regret and their intervals ------------------------------------------------------------

def test_rank_counts_eligible_configurations_and_equal_medians_share_a_rank() -> None:
    times = [[1.0, 1.0], [2.0, 2.0], [0.5, 0.5], [2.0, 2.0]]
    eligible = [True, True, False, True]  # the fastest does not fit the budget
    assert standing(times, eligible, 1) == Standing(2, 1.0, 0)
    assert standing(times, eligible, 3) == Standing(2, 1.0, 0)
    assert standing(times, eligible, 2) == Standing(1, -0.5, 0)  # placed, though over budget
    with pytest.raises(ValueError, match="no configuration is eligible"):
        standing(times, [False] * 4, 0)


def test_a_plan_fastest_in_every_round_has_no_doubt_about_it() -> None:
    times = [[1.0, 1.1, 0.9, 1.0, 1.05], [1.2, 1.3, 1.1, 1.2, 1.25]]
    plan_ci, other = bootstrap(times, [True, True], [0, 1], replicates=300, seed=1)
    assert plan_ci == {"rank_ci": [1.0, 1.0], "regret_ci": [0.0, 0.0], "p_best": 1.0}
    assert other["rank_ci"] == [2.0, 2.0] and other["p_best"] == 0.0
    lo, hi = other["regret_ci"]
    assert 0.1 < lo <= 0.2 <= hi < 0.3


def test_rounds_are_resampled_together_so_drift_cancels_in_the_regret() -> None:
    drift = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # the machine slows down round after round
    times = [drift, [1.2 * d for d in drift]]
    (ci,) = bootstrap(times, [True, True], [1], replicates=300, seed=0)
    assert ci["regret_ci"] == pytest.approx([0.2, 0.2])
    assert ci["rank_ci"] == [2.0, 2.0]


def test_configurations_trading_places_leave_the_best_in_doubt() -> None:
    times = [[1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0], [2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.05]]
    (ci,) = bootstrap(times, [True, True], [0], replicates=500, seed=0)
    assert ci["rank_ci"] == [1.0, 2.0]
    assert 0.2 < ci["p_best"] < 0.95
    assert ci["regret_ci"][0] == 0.0 and ci["regret_ci"][1] > 0.5  # the best chosen afresh


def test_bootstrap_refuses_uneven_rounds() -> None:
    with pytest.raises(ValueError, match="same rounds"):
        bootstrap([[1.0, 2.0], [1.0]], [True, True], [0], replicates=10)


# -- the configuration space ---------------------------------------------------------------------

def test_balance_neighbours_move_one_layer_across_each_boundary() -> None:
    assert balance_neighbours((4, 5)) == [(3, 6), (5, 4)]
    assert balance_neighbours((1, 2, 1)) == [(2, 1, 1), (1, 1, 2)]  # no stage left empty
    assert balance_neighbours((9,)) == []


def test_configurations_running_one_program_are_measured_once() -> None:
    gpipe, one_f = _config("gpipe", chunks=1), _config("1f1b", chunks=1)
    spared = _config("1f1b", chunks=1, checkpoint="except_last")  # recomputes nothing at m=1
    two = _config("1f1b", chunks=2)
    entries = dedupe([(gpipe, "space:none"), (one_f, "plan:none"), (spared, "default"),
                      (two, "space:none"), (two, "balance of x")])
    assert [e.config for e in entries] == [gpipe, two]
    assert entries[0].aliases == [one_f.key, spared.key]
    assert entries[0].origins == ["space:none", "plan:none", "default"]
    assert entries[1].origins == ["space:none", "balance of x"]
    assert index_of(entries, spared) == 0 and index_of(entries, two) == 1
    with pytest.raises(KeyError):
        index_of(entries, _config(chunks=4))


def test_the_space_holds_the_plan_its_table_the_splits_around_it_and_the_default() -> None:
    p = _plan()
    chosen = from_candidate(p.chosen)
    default = Config("1f1b", (), 2, "except_last", (2, 3), 1, 2)
    entries = build_space({"none": p}, {"none": math.inf}, default, vary=2, contention=1.0,
                          profile=fakes.planning_profile(), link=Link.free())
    assert "plan:none" in entries[index_of(entries, chosen)].origins
    assert "default" in entries[index_of(entries, default)].origins
    for b in balance_neighbours(chosen.balance):
        assert f"balance of {chosen.key}" in entries[index_of(entries, replace(chosen, balance=b))
                                                     ].origins
    for c in p.candidates:
        if c.status in ("chosen", "fits"):
            index_of(entries, from_candidate(c))  # every simulated candidate is measured
    pruned = [c for c in p.candidates if c.status == "pruned"]
    assert pruned
    for c in pruned:  # and every pruned one, with the split the planner gives it alone
        alone = predict(fakes.planning_profile(), Link.free(), schedule=c.schedule,
                        chunks=c.chunks, checkpoint=c.checkpoint, options=c.options, pp=c.pp)
        index_of(entries, from_candidate(alone))


def test_a_budget_keeps_out_what_is_predicted_not_to_fit_but_the_splits_around_the_plan() -> None:
    loose = _plan()
    peaks = sorted(max(c.peak_bytes) for c in loose.candidates if c.peak_bytes)
    budget = peaks[len(peaks) // 2]
    tight = _plan(budget)
    default = Config("1f1b", (), 2, "except_last", (2, 3), 1, 2)
    entries = build_space({"default": tight}, {"default": budget}, default, vary=1,
                          contention=1.0, profile=fakes.planning_profile(), link=Link.free())
    predict = predictor(fakes.planning_profile(), Link.free())
    for e in entries:
        peak = max(predict(e.config, 1.0).peak_bytes or (0,))
        assert peak <= budget or any(o.startswith("balance of") or o == "default"
                                     for o in e.origins)


def test_profile_rows_cover_every_replica_batch_and_chunk_count() -> None:
    assert profile_rows(16, 2, [1, 2, 4], processes=False) == [4, 8, 16]
    assert profile_rows(16, 2, [1, 2, 4], processes=True) == [2, 4, 8, 16]
    assert profile_rows(6, 4, [1, 2], processes=True) == [2, 3, 6]  # dp 4 does not divide 6


# -- what is stored and reported -----------------------------------------------------------------

def test_merge_times_a_step_from_the_first_start_to_the_last_end() -> None:
    c = replace(_config(balance=(5,)), pp=1, dp=2)
    first = Turn([(10.0, 10.5)], [[(0, "0F0", 10.1, 10.3)]], [0], 0, [100],
                 [{"allreduce_s": 0.02, "exposed_s": 0.01}])
    second = Turn([(10.2, 10.7)], [[(0, "0F0", 10.0, 10.6), (0, "0REDUCE_GRAD0", 10.6, 10.61)]],
                  [0], 1, [300],
                  [{"allreduce_s": 0.01, "exposed_s": 0.03}])
    (row,) = merge([[[first]], [[second]]], [c])
    (got,) = row
    assert got.step_s == [pytest.approx(0.7)]
    assert got.peaks == [300]  # the larger replica's
    assert got.allreduce_s == [0.02] and got.exposed_s == [0.03]  # the busiest process's
    (tl,) = got.timelines  # the first replica's ranks, from its first action
    assert [(e.start, e.end) for e in tl.events] == [(0.0, pytest.approx(0.2))]
    # The other replica's compute on the first's clock (its all-reduce launch is not compute).
    assert tl.meta["beside"] == [(pytest.approx(-0.1), pytest.approx(0.5))]


def test_the_planners_all_reduce_is_the_busiest_ranks_stages_in_sequence() -> None:
    link = Link("gloo", 0.0, 0.0, collective_latency=1e-3, collective_per_byte=1e-9)
    profile = fakes.planning_profile()  # 1 KiB of trainable weights per layer
    whole = Config("gpipe", (), 2, "never", (5,), 2, 1)
    assert allreduce_seconds(profile, link, whole) == pytest.approx(2 * (1e-3 + 2560e-9))
    split = Config("interleaved", (("stages_per_rank", 2),), 2, "never", (1, 1, 2, 1), 2, 2)
    assert allreduce_seconds(profile, link, split) == pytest.approx(  # rank 0: stages 0 and 2
        2 * (2e-3 + 1536e-9))
    assert allreduce_seconds(profile, link, replace(whole, dp=1, pp=2, balance=(2, 3))) == 0.0


def _record(rounds: int = 4) -> tuple[dict[str, Any], list[Entry]]:
    p = _plan()
    default = Config("1f1b", (), 2, "except_last", (2, 3), 1, 2)
    profile, link = fakes.planning_profile(), Link.free()
    entries = build_space({"none": p}, {"none": math.inf}, default, vary=1, contention=1.0,
                          profile=profile, link=link)
    configs = [e.config for e in entries]
    predict = predictor(profile, link)
    # Each configuration measured at 1.1x its prediction, plus 1 ms a turn per round number.
    seconds = {c.key: 1.1 * (predict(c, 1.0).step_time or 0.0) for c in configs}
    raw = run_rounds(configs, orders(len(configs), rounds, 0),
                     fakes.planning_turn(lambda c, k: seconds[c.key] + 0.001 * k, []))
    measured: list[list[Measured]] = merge([raw], configs)
    rows = config_rows(entries, measured, predict, 1.0)
    results = {"none": results_for(rows, entries, math.inf, from_candidate(p.chosen), default,
                                   replicates=100, seed=0)}
    record = {"model": "fake", "transport": "threads", "rounds": rounds, "steps": 1,
              "warmup": 1, "replicates": 100, "results": results,
              "error_sources": error_sources(rows), "configs": rows}
    return record, entries


def test_every_measurement_is_stored_with_its_prediction() -> None:
    record, entries = _record(rounds=4)
    rows = record["configs"]
    assert [r["key"] for r in rows] == [e.config.key for e in entries]
    for r in rows:
        m = r["measured"]
        assert len(m["step_s"]) == 4 and all(len(s) == 1 for s in m["step_s"])
        assert m["round_s"] == pytest.approx([s[0] for s in m["step_s"]], abs=1e-7)
        assert m["peak_bytes"] == [1000, 2000] and len(m["anatomy"]) == 4
        assert r["error"] == pytest.approx(r["predicted"]["step_s"] / m["median_s"] - 1)
        parts = r["error_parts_s"]
        assert parts["compute"] + parts["idle"] + parts["outside"] == \
            pytest.approx(parts["total"])
        assert parts["total"] == pytest.approx(r["predicted"]["step_s"] - r["mean_step_s"])
    by_chunks = record["error_sources"]["by_chunks"]
    assert sorted(by_chunks, key=int) == sorted({str(r["config"]["chunks"]) for r in rows},
                                                key=int)
    assert sum(g["n"] for g in by_chunks.values()) == len(rows)
    json.dumps(record)  # the record is what results.json holds


def test_results_name_the_fastest_and_place_the_plan_and_default_against_it() -> None:
    record, _ = _record()
    res = record["results"]["none"]
    rows = record["configs"]
    fastest = min(rows, key=lambda r: r["measured"]["median_s"])
    assert res["best"]["key"] == fastest["key"]
    for who in ("plan", "default"):
        row = next(r for r in rows if r["key"] == res[who]["key"])
        assert res[who]["regret"] == pytest.approx(row["measured"]["median_s"]
                                                   / fastest["measured"]["median_s"] - 1)
        assert res[who]["rank"] == 1 + sum(r["measured"]["median_s"]
                                           < row["measured"]["median_s"] for r in rows)
        lo, hi = res[who]["rank_ci"]
        assert lo <= hi
    assert res["eligible"] == res["measured"] == len(rows)
    assert res["spearman"] > 0.9  # measured 1.1x the prediction: the same order


def test_the_report_shows_rank_regret_intervals_and_the_error() -> None:
    record, _ = _record()
    res = record["results"]["none"]["plan"]
    text = report([record], "python -m benchmarks.planning --models fake")
    n = record["results"]["none"]["eligible"]
    lo, hi = res["rank_ci"]
    assert f"| {res['rank']} of {n} [{lo:.0f}, {hi:.0f}] |" in text
    assert "`python -m benchmarks.planning --models fake`" in text
    error = record["error_sources"]["error"]["median_abs"]
    assert f"| fake | threads | {len(record['configs'])} | {error * 100:.1f}% |" in text


def test_error_summary_and_its_parts() -> None:
    e = error_summary([-0.2, -0.1, 0.0, 0.05, 0.3])
    assert e["median_abs"] == pytest.approx(0.1)
    assert e["within"] == {"5%": 0.4, "10%": 0.6, "20%": 0.8}
    assert e["under_predicted"] == 0.4
    assert spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)


def test_the_error_parts_add_up_on_a_real_timeline() -> None:
    from benchmarks.stats import merge_events

    measured = merge_events(2, [(0, "0F0", 1.0, 1.3), (1, "1F0", 1.4, 1.6),
                                (1, "1B0", 1.6, 2.0), (0, "0B0", 2.1, 2.5)], 1.0)
    planned = merge_events(2, [(0, "0F0", 0.0, 0.2), (1, "1F0", 0.2, 0.4),
                               (1, "1B0", 0.4, 0.8), (0, "0B0", 0.8, 1.2)], 0.0)
    m, p = anatomy(measured, 1.7), anatomy(planned)
    assert m.span == pytest.approx(1.5) and m.busy == pytest.approx((0.7, 0.6))
    parts = decompose(p, m)
    assert parts["compute"] == pytest.approx(0.6 - 0.7)
    assert parts["outside"] == pytest.approx(-0.2)
    assert sum(parts[k] for k in ("compute", "idle", "outside")) == pytest.approx(1.2 - 1.7)


def test_calibration_finds_the_contention_and_overheads_behind_the_measurements() -> None:
    configs = [_config(chunks=m, balance=b) for m in (1, 2, 4, 8) for b in ((2, 3), (3, 2))]
    actions = [2 * c.chunks for c in configs]
    work = [0.01 * (1 + i % 3) + 0.002 * c.chunks for i, c in enumerate(configs)]

    def predict(c: Config, contention: float) -> float:  # the overlapped half slows down
        i = configs.index(c)
        return work[i] * (0.5 + 0.5 * contention)

    measured = [predict(c, 2.0) + 0.003 + 0.0002 * a for c, a in zip(configs, actions,
                                                                     strict=True)]
    got = calibrate(configs, measured, actions, predict, contention=1.2)
    assert got["as_measured"] > 0.2
    assert [f["contention"] for f in got["fitted"]] != [1.2, 1.2]
    assert got["contention_and_overheads"] < 1e-6  # exact once both are fitted
    for f in got["fitted"]:
        assert f["contention"] == pytest.approx(2.0)
        assert f["per_step_s"] == pytest.approx(0.003) and f["per_action_s"] == \
            pytest.approx(0.0002)
    assert halves(5) == ([0, 2, 4], [1, 3])
    assert fit_line([1.0, 2.0, 3.0], [3.0, 5.0, 7.0]) == pytest.approx((1.0, 2.0))


def _fake_run(monkeypatch: pytest.MonkeyPatch, *, refuse_budgets: bool = False
              ) -> dict[str, Any]:
    """`planning.run` on the tiny model with every measurement faked: the synthetic profile
    (5 layers, batch 16, as tiny), a free link, no contention, and steps that take 1.1x their
    prediction."""
    import benchmarks.planning.run as planning

    profile = fakes.planning_profile()
    predict = predictor(profile, Link.free())

    def fake_measure(name: str, configs: list[Config], *, transport: str, ranks: int,
                     turns: list[list[int]], steps: int, warmup: int) -> list[list[Measured]]:
        seconds = {c.key: 1.1 * (predict(c, 1.0).step_time or 0.0) for c in configs}
        raw = run_rounds(configs, turns, fakes.planning_turn(lambda c, k: seconds[c.key], []))
        return merge([raw], configs)

    def fake_plan(*args: Any, **kwargs: Any) -> Plan:
        if refuse_budgets and kwargs["memory_per_rank"] is not None:
            raise PlanError("nothing fits", 1.0, ())
        return plan(*args, **kwargs)

    monkeypatch.setattr(planning, "measure_link", lambda transport: Link.free())
    monkeypatch.setattr(planning, "measure_contention", lambda *a, **k: 1.0)
    monkeypatch.setattr(planning, "profile_model", lambda *a, **k: profile)
    monkeypatch.setattr(planning, "measure", fake_measure)
    monkeypatch.setattr(planning, "plan", fake_plan)
    return planning.run("tiny", "threads", ranks=2, chunks=[1, 2], budgets=["default", "none"],
                        rounds=3, steps=1, warmup=1, vary=1, seed=0, replicates=50,
                        profile=profile)


def test_a_run_measures_the_plans_and_default_among_everything_else(
        monkeypatch: pytest.MonkeyPatch) -> None:
    record = _fake_run(monkeypatch)
    keys = [c["key"] for c in record["configs"]]
    assert len(keys) == len(set(keys)) > 10
    assert all(sorted(o) == list(range(len(keys))) for o in record["orders"])
    assert all(len(c["measured"]["round_s"]) == 3 for c in record["configs"])
    assert set(record["results"]) == {"default", "none"} and record["plan_errors"] == {}
    for res in record["results"].values():
        assert res["plan"]["key"] in keys and res["default"]["key"] in keys
        assert res["measured"] == len(keys)
    origins = [o for c in record["configs"] for o in c["origins"]]
    assert {"plan:default", "plan:none", "default"} <= set(origins)
    json.dumps(record)


def test_a_budget_the_planner_cannot_meet_is_reported_not_fatal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    record = _fake_run(monkeypatch, refuse_budgets=True)
    assert record["plan_errors"] == {"default": "nothing fits"}
    assert set(record["results"]) == {"none"}
    assert "the planner found no configuration: nothing fits" in report([record])


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    assert main(["--models", "tiny", "--transports", "threads", "--chunks", "1,2",
                 "--rounds", "2", "--steps", "1", "--replicates", "50", "--vary", "1",
                 "--profile-repeats", "1", "--trials", "2", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| tiny | threads | default: " in text and "| tiny | threads | none: " in text
    data = json.loads((tmp_path / "results.json").read_text())
    (record,) = data["records"]
    assert all(len(c["measured"]["round_s"]) == 2 for c in record["configs"])
    assert set(record["drift"]["profile_after_over_before"]) == {"8", "16"}  # m = 2, 1
    assert (tmp_path / "timelines" / "tiny-threads-plan-none-measured.json").exists()
    # Planned with trials: the plan is the measured fastest of the 2 best predicted.
    planned = record["results"]["none"]["plan"]
    assert planned["trials"] == 2 and planned["measured_in_trials_s"] > 0
    # The fitted time model, scored on the configurations held out of each half's fit.
    held = record["what_if"]["time_model"]
    assert held["n"] == len(record["configs"]) and 0 <= held["median_abs"] < 10
    assert len(held["fitted"]) == 2 and all(f["compute"] > 0 for f in held["fitted"])
    assert "the fitted time model: median" in text
    # The report again from the stored results, measuring nothing: the same text.
    again = tmp_path / "again"
    assert main(["--from", str(tmp_path / "results.json"), "--out", str(again)]) == 0
    assert (again / "report.md").read_text() == text


def test_the_noise_floor_is_the_error_of_a_median_over_few_rounds() -> None:
    """Two rounds of 1 and 2 s: resampled, their median is 1, 1.5 or 2 (a quarter, a half and
    a quarter of the time), off from 1.5 by a third, 0 and a third: 1/6 on average. Rounds
    that agree have no error."""
    def config(rounds: list[float]) -> dict[str, Any]:
        return {"measured": {"round_s": rounds}}

    assert noise_floor([config([1.0, 2.0])], resamples=20_000) == pytest.approx(1 / 6, rel=0.03)
    assert noise_floor([config([3.0] * 5)]) == 0.0
    assert noise_floor([config([3.0] * 5), config([1.0, 2.0]), config([1.0, 2.0])],
                       resamples=20_000) == pytest.approx(1 / 6, rel=0.03)


def test_a_time_model_fitted_on_half_predicts_the_other_half() -> None:
    """Configurations 'measured' on a simulated machine with known terms: the model fitted on
    either half predicts the held-out half exactly (every term is recovered)."""
    profile, link = fakes.planning_profile(), Link("gloo", 1e-4, 1e-9)
    truth = TimeModel(compute=1.3, action=2e-4, message=5e-4, step=1e-3)
    configs = [Config(s, (), m, "never", (2, 3)) for s in ("gpipe", "1f1b", "zb-h1")
               for m in (1, 2, 4)]

    def run(c: Config, model: TimeModel | None) -> tuple[float, Any]:
        got = predict(profile, link, schedule=c.schedule, chunks=c.chunks,
                      checkpoint=c.checkpoint, balance=c.balance, time_model=model)
        assert got.step_time is not None and got.timeline is not None
        return got.step_time, got.timeline

    def measured(c: Config) -> tuple[float, Any]:
        step, tl = run(c, truth)
        return step, schedules.Timeline(tl.num_ranks, tl.events, "s", tl.meta)

    steps = [[measured(c)] for c in configs]
    held = time_model_what_if(configs, steps, [run(c, None)[1] for c in configs],
                              [s[0][0] for s in steps], lambda c, m: run(c, m)[0],
                              [8 // c.chunks for c in configs])
    assert held["n"] == 9 and held["median_abs"] == pytest.approx(0.0, abs=1e-9)
    assert held["one_scale"]["median_abs"] == pytest.approx(0.0, abs=1e-9)
    assert held["within"]["5"] == 1.0
    for f in held["fitted"]:
        assert f["compute"] == pytest.approx(1.3) and f["step"] == pytest.approx(1e-3)
        assert f["rows"] == {8: pytest.approx(1.3), 4: pytest.approx(1.3),
                             2: pytest.approx(1.3)}
