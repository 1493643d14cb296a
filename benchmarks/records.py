"""One JSON record per configuration, built from a group's measurements, and its schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.config import Group, stages_per_rank
from benchmarks.harness import Measured, Sample, bound_key
from benchmarks.stats import (
    comm_latency,
    costs_to_dict,
    idle_not_waiting,
    merge_events,
    paired_ratio,
    predict,
    ratio,
    stage_costs,
    summarize,
)
from benchmarks.torch_baseline import TORCH_PEERS
from pipeline.examples.models import get_model
from pipeline.planner.contention import Reading, Window
from schedules import Schedule, Timeline, get_schedule, info

__all__ = ["SCHEMA", "build_records", "record_id", "schedule_for", "validate_record"]

SCHEMA = "pipeline-bench/1"


def record_id(model: str, method: str, transport: str, num_ranks: int, schedule: str,
              m: int) -> str:
    return f"{model}/{method}/{transport}/p{num_ranks}/{schedule}/m{m}"


def schedule_for(name: str, num_ranks: int, m: int) -> Schedule:
    """The schedule Pipe runs for `name`, at its generator's default stages per rank."""
    options = info(name).options_for(stages_per_rank=stages_per_rank(name))
    return get_schedule(name, num_ranks, m, **options)


def _times(samples: list[Sample | None] | None) -> list[float]:
    return [s[1] - s[0] for s in samples or [] if s is not None]


def _summary(values: list[float]) -> dict[str, Any] | None:
    return summarize(values).to_dict() if values else None


def _contention(samples: list[Sample | None] | None, cpu: list[float | None] | None, *,
                threads: int, busy: float, cores: int,
                load: tuple[float | None, float | None],
                window: Window | None) -> dict[str, Any] | None:
    """One cell's rounds as one contention reading (pipeline/planner/contention.py), with what
    other programs took over the window of every variant's rounds (the variants take turns,
    so whatever else ran fell on all of them alike); None where its CPU time was not
    measured."""
    if not samples or not cpu:  # measurements from before CPU time was counted
        return None
    rounds = [Reading(s[1] - s[0], c, threads, cores, load[0], load[1], busy)
              for s, c in zip(samples, cpu, strict=True) if s is not None and c is not None]
    total = Reading.total(rounds)
    return None if total is None else total.with_window(window).to_dict()


def _median_index(values: list[float]) -> int:
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def _record(group: Group, m: int, transport: str, schedule: str, measured: Measured,
            environment: Mapping[str, Any]) -> tuple[dict[str, Any], Timeline | None]:
    p, s = group.num_ranks, schedule
    samples = measured.samples
    ours = [x for x in samples.get(f"{transport}/ours/{s}", []) if x is not None]
    ours_t = [end - start for start, end, _ in ours]
    balance = list(group.balances[s])
    meta = {"schedule": s, "num_ranks": p, "num_stages": len(balance),
            "num_microbatches": m, "transport": transport, "model": group.model}
    timelines = [merge_events(p, events or [], start, meta) for start, _, events in ours]
    torch_key = f"{transport}/torch/{s}"
    torch_t = _times(samples.get(torch_key))
    bound_t = _times(samples.get(bound_key(transport, balance)))
    plain1, plain_all = _times(samples.get("plain/1")), _times(samples.get("plain/all"))
    step = summarize(ours_t)
    makespan = summarize(tl.makespan for tl in timelines)
    batch = float(get_model(group.model).batch_size)
    plan = schedule_for(s, p, m)
    costs = stage_costs(timelines, plan.num_stages)
    predicted = predict(plan, costs)
    memory = measured.memory.get(f"{transport}/ours/{s}", {})
    torch_memory = measured.memory.get(torch_key, {})
    plain1_s = summarize(plain1) if plain1 else None
    bound_s = summarize(bound_t) if bound_t else None
    cores = int(environment.get("num_cpus") or 1)

    def contended(key: str, threads: int, busy: float = 1.0) -> dict[str, Any] | None:
        return _contention(samples.get(key), measured.cpu.get(key), threads=threads,
                           busy=busy, cores=cores, load=measured.load,
                           window=measured.window)

    # The pipelines' ranks have work outside the schedule's bubble only.
    pipe_busy = 1 - predicted.bubble_fraction
    record = {
        "schema": SCHEMA,
        "id": record_id(group.model, group.balance_method, transport, p, s, m),
        "config": {"model": group.model, "balance_method": group.balance_method,
                   "balance": balance, "transport": transport, "num_ranks": p,
                   "num_stages": len(balance), "schedule": s, "num_microbatches": m,
                   "batch_size": int(batch), "device": group.device,
                   "checkpoint": "never"},
        "environment": dict(environment),
        "warmup": group.warmup,
        "repeats": group.repeats,
        "step_time_s": step.to_dict(),
        "samples_per_s": step.inverse(batch).to_dict(),
        "bubble_fraction": summarize(tl.bubble_fraction for tl in timelines).to_dict(),
        "peak_stashed_bytes": memory.get("peak_stashed_bytes", []),
        "peak_stashed_microbatches": memory.get("peak_stashed_microbatches", []),
        "peak_activation_bytes": memory.get("peak_activation_bytes", []),
        "simulator": {"predicted_step_s": predicted.makespan,
                      "predicted_bubble_fraction": predicted.bubble_fraction,
                      "error": predicted.makespan / step.median - 1,
                      "error_vs_timeline": predicted.makespan / makespan.median - 1,
                      "costs_s": costs_to_dict(costs)},
        # Where a step's time goes besides compute and the schedule's bubbles: idle with the
        # input at hand (runtime and transfer overhead), and before/after the first/last action.
        "overhead_s": {"idle_with_input_ready": summarize(
                           idle_not_waiting(tl) for tl in timelines).to_dict(),
                       # Producer's end to consumer's start on another rank, where the
                       # consumer was idle waiting: what a message costs the step.
                       "message_wait": summarize(
                           comm_latency([tl]) for tl in timelines).to_dict(),
                       "outside_timeline": summarize(
                           t - tl.makespan for t, tl in zip(ours_t, timelines, strict=True)
                       ).to_dict()},
        "torch": {"schedule": TORCH_PEERS.get(s), "step_time_s": _summary(torch_t),
                  "skipped": measured.skipped.get(torch_key),
                  # Counted as ours is (TorchPipeline.memory_step); None where torch did not run.
                  "peak_stashed_bytes": torch_memory.get("peak_stashed_bytes"),
                  "peak_stashed_microbatches": torch_memory.get("peak_stashed_microbatches"),
                  "peak_activation_bytes": torch_memory.get("peak_activation_bytes")},
        "baselines": {"plain_1_thread_s": _summary(plain1),
                      "plain_all_threads_s": _summary(plain_all),
                      "hardware_bound_s": _summary(bound_t)},
        "ratios": {
            "ours_over_torch": ratio(step, summarize(torch_t)) if torch_t else None,
            "ours_over_torch_paired": paired_ratio(ours_t, torch_t) if torch_t else None,
            "speedup_vs_plain_1_thread": ratio(plain1_s, step),
            "speedup_vs_plain_all_threads": (ratio(summarize(plain_all), step)
                                             if plain_all else None),
            "efficiency_ideal": (None if plain1_s is None else
                                 plain1_s.median / p / step.median),
            # A bound is the fastest the hardware did the work: its quickest round, so a
            # disturbed round of the bound never flatters ours.
            "efficiency_hardware_bound": None if bound_s is None else bound_s.min / step.median,
            "overhead_vs_plain_1_thread": ratio(step, plain1_s) if p == 1 else None,
        },
        # Whether each figure was measured with the CPUs it needed (contention.py).
        "contention": {
            "ours": contended(f"{transport}/ours/{s}", p, pipe_busy),
            "torch": contended(torch_key, p, pipe_busy),
            "plain_1_thread": contended("plain/1", 1),
            "plain_all_threads": contended(
                "plain/all", int(environment.get("plain_all_threads") or cores)),
            "hardware_bound": contended(bound_key(transport, balance), p)},
        "timeline": None,
    }
    best = timelines[_median_index(ours_t)] if timelines else None
    return record, best


def build_records(group: Group, measured: Mapping[int, Measured],
                  environment: Mapping[str, Any]) -> list[tuple[dict[str, Any], Timeline | None]]:
    """Every configuration of the group: (record, the timeline of its median step)."""
    out = []
    for m, meas in measured.items():
        for transport in group.transports:
            for s in group.schedules:
                if f"{transport}/ours/{s}" in meas.samples:
                    out.append(_record(group, m, transport, s, meas, environment))
    return out


_SUMMARY_KEYS = ("median", "min", "max", "n")
_TOP = {"schema": str, "id": str, "config": dict, "environment": dict, "warmup": int,
        "repeats": int, "step_time_s": dict, "samples_per_s": dict, "bubble_fraction": dict,
        "peak_stashed_bytes": list, "peak_stashed_microbatches": list, "simulator": dict,
        "overhead_s": dict,
        "torch": dict, "baselines": dict, "ratios": dict}
_CONFIG = {"model": str, "balance_method": str, "balance": list, "transport": str,
           "num_ranks": int, "num_stages": int, "schedule": str, "num_microbatches": int,
           "batch_size": int, "device": str, "checkpoint": str}
_RATIOS = ("ours_over_torch", "ours_over_torch_paired", "speedup_vs_plain_1_thread",
           "speedup_vs_plain_all_threads", "efficiency_ideal", "efficiency_hardware_bound",
           "overhead_vs_plain_1_thread")
_ENVIRONMENT = ("torch", "python", "platform", "cpu", "gpu", "num_cpus", "threads_per_rank",
                "git_commit")


def _check_summary(value: Any, where: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, dict) or set(value) != set(_SUMMARY_KEYS):
        raise ValueError(f"{where} must be a summary with keys {_SUMMARY_KEYS} (got {value!r})")
    if not all(isinstance(value[k], int | float) for k in _SUMMARY_KEYS):
        raise ValueError(f"{where} holds a non-number: {value!r}")
    if not value["min"] <= value["median"] <= value["max"]:
        raise ValueError(f"{where}: min <= median <= max does not hold: {value!r}")


def validate_record(record: Any) -> None:
    """Raise ValueError naming the first field of `record` that breaks the schema."""
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object (got {type(record).__name__})")
    for table, spec, where in ((record, _TOP, "record"),
                               (record.get("config"), _CONFIG, "config")):
        if not isinstance(table, dict):
            raise ValueError(f"{where} must be an object")
        for key, kind in spec.items():
            if key not in table:
                raise ValueError(f"{where} lacks {key!r}")
            if not isinstance(table[key], kind) or (kind is int and isinstance(table[key], bool)):
                raise ValueError(f"{where}.{key} must be {kind.__name__} "
                                 f"(got {type(table[key]).__name__})")
    if record["schema"] != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA!r} (got {record['schema']!r})")
    missing = [k for k in _ENVIRONMENT if k not in record["environment"]]
    if missing:
        raise ValueError(f"environment lacks {missing}")
    for key in ("step_time_s", "samples_per_s", "bubble_fraction"):
        _check_summary(record[key], key)
    for key in ("plain_1_thread_s", "plain_all_threads_s", "hardware_bound_s"):
        _check_summary(record["baselines"].get(key), f"baselines.{key}", optional=True)
    _check_summary(record["torch"].get("step_time_s"), "torch.step_time_s", optional=True)
    for key in _RATIOS:
        value = record["ratios"].get(key, "missing")
        if value is not None and not isinstance(value, int | float):
            raise ValueError(f"ratios.{key} must be a number or null (got {value!r})")
    sim = record["simulator"]
    for key in ("predicted_step_s", "error"):
        if not isinstance(sim.get(key), int | float):
            raise ValueError(f"simulator.{key} must be a number (got {sim.get(key)!r})")
    for key, cell in (record.get("contention") or {}).items():
        if cell is not None and not (isinstance(cell, dict)
                                     and isinstance(cell.get("contended"), bool)):
            raise ValueError(f"contention.{key} must be null or an object with a boolean "
                             f"'contended' (got {cell!r})")
    if len(record["peak_stashed_bytes"]) != record["config"]["num_ranks"]:
        raise ValueError(f"peak_stashed_bytes needs one entry per rank "
                         f"(got {record['peak_stashed_bytes']!r})")
