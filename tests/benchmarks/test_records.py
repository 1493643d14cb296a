"""benchmarks.records: figures computed from measurements, and the JSON schema."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks.records import SCHEMA, build_records, record_id, validate_record
from tests.benchmarks import fakes


def _records(p: int = 2, m: int = 4) -> dict[str, dict]:  # type: ignore[type-arg]
    g = fakes.group(p)
    built = build_records(g, {m: fakes.measured(g, m)}, fakes.ENV)
    return {r["id"]: r for r, _ in built}


def test_one_record_per_transport_and_schedule() -> None:
    records = _records()
    assert sorted(records) == sorted(
        record_id("tiny", "params", t, 2, s, 4) for t in ("processes", "threads")
        for s in ("gpipe", "1f1b", "zb-h1"))
    for r in records.values():
        validate_record(r)
        json.dumps(r)  # plain JSON


def test_figures_follow_from_the_samples() -> None:
    r = _records()[record_id("tiny", "params", "processes", 2, "1f1b", 4)]
    step = r["step_time_s"]
    # Makespan of 1f1b, p=2, m=4 under F=1ms, B=2ms: 3 * (4 + 2 - 1) = 15 ms; plus overhead
    # of 0.5, 1.0, 1.5 ms in rounds 0..2.
    assert step == pytest.approx({"median": 0.016, "min": 0.0155, "max": 0.0165, "n": 3})
    assert r["samples_per_s"]["median"] == pytest.approx(16 / 0.016)
    assert r["ratios"]["ours_over_torch"] == pytest.approx(0.016 / (0.0155 * 1.25))
    assert r["ratios"]["speedup_vs_plain_1_thread"] == pytest.approx(0.03 / 0.016)
    assert r["ratios"]["speedup_vs_plain_all_threads"] == pytest.approx(0.02 / 0.016)
    assert r["ratios"]["efficiency_ideal"] == pytest.approx(0.03 / 2 / 0.016)
    # The bound's fastest round (all rounds equal here) over our median.
    assert r["ratios"]["efficiency_hardware_bound"] == pytest.approx(0.012 / 0.016)
    assert r["ratios"]["overhead_vs_plain_1_thread"] is None  # p > 1
    # The measured timeline is exactly the simulated one: its bubble is 1f1b's closed form.
    assert r["bubble_fraction"]["median"] == pytest.approx(1 / 5)
    # Costs profiled from the timeline give back the makespan; the error is the overhead.
    assert r["simulator"]["predicted_step_s"] == pytest.approx(0.015)
    assert r["simulator"]["error"] == pytest.approx(0.015 / 0.016 - 1)
    assert r["simulator"]["costs_s"]["forward"] == pytest.approx([0.001, 0.001])
    assert r["simulator"]["error_vs_timeline"] == pytest.approx(0.0)
    assert r["overhead_s"]["outside_timeline"]["median"] == pytest.approx(0.001)
    assert r["overhead_s"]["idle_with_input_ready"]["max"] == pytest.approx(0.0)
    assert r["peak_stashed_bytes"] == [1000, 2000]
    assert r["torch"]["schedule"] == "Schedule1F1B" and r["torch"]["skipped"] is None
    assert r["torch"]["peak_stashed_bytes"] == [1500, 3000]  # torch's peer, next to ours
    assert r["torch"]["peak_stashed_microbatches"] == [2, 2]


def test_threads_records_say_why_torch_is_missing() -> None:
    r = _records()[record_id("tiny", "params", "threads", 2, "gpipe", 4)]
    assert r["torch"]["step_time_s"] is None and r["ratios"]["ours_over_torch"] is None
    assert "one process per rank" in r["torch"]["skipped"]
    assert r["torch"]["peak_stashed_bytes"] is None


def test_one_rank_records_carry_the_overhead() -> None:
    r = _records(p=1)[record_id("tiny", "params", "processes", 1, "1f1b", 4)]
    assert r["ratios"]["overhead_vs_plain_1_thread"] == pytest.approx(
        r["step_time_s"]["median"] / 0.03)


@pytest.mark.parametrize(("path", "value", "message"), [
    (("schema",), "other/9", "schema"),
    (("config", "num_ranks"), "2", "config.num_ranks must be int"),
    (("config", "num_ranks"), True, "config.num_ranks must be int"),
    (("step_time_s",), {"median": 1.0}, "summary"),
    (("step_time_s",), {"median": 5.0, "min": 1.0, "max": 2.0, "n": 3}, "min <= median"),
    (("ratios", "ours_over_torch"), "fast", "ratios.ours_over_torch"),
    (("simulator", "error"), None, "simulator.error"),
    (("peak_stashed_bytes",), [1], "one entry per rank"),
    (("environment",), {}, "environment lacks"),
])
def test_validate_record_names_what_is_wrong(path: tuple[str, ...], value: object,
                                            message: str) -> None:
    record = copy.deepcopy(next(iter(_records().values())))
    target = record
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=message):
        validate_record(record)


def test_validate_record_wants_every_field() -> None:
    record = next(iter(_records().values()))
    assert record["schema"] == SCHEMA
    del record["bubble_fraction"]
    with pytest.raises(ValueError, match="lacks 'bubble_fraction'"):
        validate_record(record)
    with pytest.raises(ValueError, match="JSON object"):
        validate_record([])
