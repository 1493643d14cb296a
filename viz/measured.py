"""A measured timeline's prediction: the simulator's timeline of the same schedule and step.

The schedule comes from the timeline's meta (name, ranks, stages, micro-batches, batches and a
program's syncs, as the runtime records them); the costs from the timeline itself: each op's
median duration per stage, and as `comm` the median delay from a producer's end to its
consumer's start on another rank where the consumer sat idle waiting for it. Drawn above or
beside the measured step (`pipeviz timeline.json --predicted`), the difference is what the
simulator does not have: slow actions, the runtime's gaps, messages that cost more than
their median.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import schedules
from schedules import Action, Costs, Event, Op, Schedule, ScheduleError, Syncs, Timeline
from schedules.lower import consumed, source_stage
from viz.compare import Comparison, compare
from viz.layout import layout

__all__ = ["measured_costs", "over_predicted", "predicted", "schedule_of"]

_FIELDS = {Op.F: "forward", Op.B: "backward", Op.I: "backward_input", Op.W: "backward_weight",
           Op.U: "update"}


def schedule_of(meta: Mapping[str, Any]) -> Schedule:
    """The schedule a measured timeline ran, from its meta; ScheduleError if it cannot say."""
    try:
        name = str(meta["schedule"])
        ranks, m = int(meta["num_ranks"]), int(meta["num_microbatches"])
    except (KeyError, TypeError, ValueError):
        raise ScheduleError("the timeline's meta does not name its schedule (schedule, "
                            "num_ranks, num_microbatches): nothing to predict") from None
    gen = schedules.info(name)
    v = int(meta.get("num_stages", ranks * gen.stages_per_rank)) // ranks
    options = gen.options_for(stages_per_rank=v, num_batches=int(meta.get("num_batches", 1)))
    schedule = schedules.get_schedule(name, ranks, m, **options)
    syncs = Syncs.parse(str(meta.get("syncs", "none")))
    return schedules.program(schedule, syncs) if syncs != Syncs() else schedule


def _source(index: Mapping[tuple[int, Op, int], Event], a: Action, num_stages: int
            ) -> Event | None:
    msg = consumed(a, num_stages)
    if msg is None or msg[0] not in "FB":
        return None
    src = source_stage(msg)
    if msg[0] == "F":
        return index.get((src, Op.F, a.microbatch))
    return index.get((src, Op.B, a.microbatch)) or index.get((src, Op.I, a.microbatch))


def _comm(timeline: Timeline, num_stages: int) -> float:
    index = {(e.action.stage, e.action.op, e.action.microbatch): e for e in timeline.events}
    gaps = []
    for r in range(timeline.num_ranks):
        lane = [e for e in timeline.lane(r) if e.action.is_compute]
        for prev, e in zip((None, *lane), lane, strict=False):
            src = _source(index, e.action, num_stages)
            if src is not None and src.rank != e.rank and (prev is None or prev.end <= src.end):
                gaps.append(max(0.0, e.start - src.end))  # idle when the data left
    return statistics.median(gaps) if gaps else 0.0


def measured_costs(timeline: Timeline, num_stages: int) -> Costs:
    """Per stage, each op's median duration in `timeline`; `comm`, the median message delay."""
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in timeline.events:
        kind = _FIELDS.get(e.action.op)
        if kind is not None:
            samples[(kind, e.action.stage)].append(e.end - e.start)

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(statistics.median(samples[(kind, s)]) if samples.get((kind, s)) else 0.0
                     for s in range(num_stages))

    return Costs(forward=per_stage("forward"), backward=per_stage("backward"),
                 backward_input=per_stage("backward_input"),
                 backward_weight=per_stage("backward_weight"), update=per_stage("update"),
                 comm=_comm(timeline, num_stages))


def _format(costs: Costs) -> str:
    def ms(value: float | Sequence[float]) -> str:
        values = value if isinstance(value, Sequence) else (value,)
        return "/".join(f"{v * 1e3:.3g}" for v in values)

    used = [(k, getattr(costs, f)) for k, f in (("F", "forward"), ("B", "backward"),
                                                ("I", "backward_input"),
                                                ("W", "backward_weight"), ("U", "update"))]
    parts = [f"{k}={ms(v)}" for k, v in used
             if any(x > 0 for x in (v if isinstance(v, Sequence) else (v,)))]
    return " ".join([*parts, f"comm={ms(costs.comm)}"]) + " ms"


def predicted(timeline: Timeline) -> Timeline:
    """The simulator's timeline of the schedule `timeline` ran, under its own costs (seconds)."""
    if timeline.unit != "s":
        raise ScheduleError("a prediction is made for a measured timeline (unit 's'); this "
                            "one is planned")
    schedule = schedule_of(timeline.meta)
    costs = measured_costs(timeline, schedule.num_stages)
    planned = schedules.simulate(schedule, costs)
    meta = {**planned.meta, "predicted": True, "costs": _format(costs)}
    return Timeline(planned.num_ranks, planned.events, "s", meta)


def over_predicted(measured: Timeline) -> Comparison:
    """The measured step above its prediction, on one time axis (`pipeviz --predicted`)."""
    guess = predicted(measured)
    name = str(measured.meta.get("schedule", "timeline"))
    pair = compare([layout(measured, title=f"{name}, measured"),
                    layout(guess, title=f"{name}, predicted")],
                   title=f"{name}: measured over predicted", ranked=False)
    return dataclasses.replace(
        pair, subtitle=f"{measured.num_ranks} ranks; times in {pair.unit_name()}; predicted: "
                       f"the simulator under this step's own costs ({guess.meta['costs']})")
