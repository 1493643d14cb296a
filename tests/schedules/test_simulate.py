import itertools
import json

import pytest
from hypothesis import given

import schedules
from schedules import Costs, Op, Schedule, ScheduleError, Timeline
from tests.strategies import schedules_any


def test_costs_parse() -> None:
    c = Costs.parse("F=1.5, B=3,comm=0.25")
    assert (c.forward, c.backward, c.comm) == (1.5, 3.0, 0.25)
    assert c.backward_input == 1.0  # default kept
    with pytest.raises(ValueError, match="NAME one of F, B, I, W, U, comm"):
        Costs.parse("X=1")
    with pytest.raises(ValueError, match="not a number"):
        Costs.parse("F=fast")
    with pytest.raises(ValueError, match="must be >= 0"):
        Costs(forward=-1)


def test_per_stage_costs_and_latency() -> None:
    s = schedules.get_schedule("gpipe", 2, 1)
    t = schedules.simulate(s, Costs(forward=(1, 3), backward=(2, 4), comm=0.5))
    got = {str(e.action): (e.start, e.end) for e in t.events}
    assert got == {"0F0": (0, 1), "1F0": (1.5, 4.5), "1B0": (4.5, 8.5), "0B0": (9.0, 11.0)}
    with pytest.raises(ValueError, match="one value per stage"):
        schedules.simulate(s, Costs(forward=(1,)))


def test_comm_latency_slows_the_pipeline() -> None:
    s = schedules.get_schedule("1f1b", 4, 8)
    assert schedules.simulate(s, Costs(comm=0.5)).makespan > schedules.simulate(s).makespan


def test_bubble_counts_idle_rank_time() -> None:
    t = schedules.simulate(schedules.get_schedule("gpipe", 2, 1))
    # makespan 1 + 1 + 2 + 2 = 6; each rank busy 3.
    assert t.makespan == 6
    assert t.rank_bubble == (0.5, 0.5)
    assert t.bubble_fraction == 0.5


@given(schedules_any())
def test_timeline_is_consistent(schedule: Schedule) -> None:
    t = schedules.simulate(schedule)
    for r in range(schedule.num_ranks):
        lane = t.lane(r)
        assert [e.action for e in lane] == list(schedule.actions[r])
        assert all(a.end <= b.start for a, b in itertools.pairwise(lane))
    end = {(e.action.stage, e.action.op, e.action.microbatch): e.end for e in t.events}
    for e in t.events:  # a forward starts only after the previous stage's forward ended
        a = e.action
        if a.op is Op.F and a.stage > 0:
            assert e.start >= end[(a.stage - 1, Op.F, a.microbatch)]
    assert 0 <= t.bubble_fraction < 1
    assert Timeline.from_json(t.to_json()) == t


def test_chrome_trace() -> None:
    t = schedules.simulate(schedules.get_schedule("1f1b", 2, 2))
    trace = json.loads(json.dumps(t.to_chrome_trace()))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(t.events)
    assert {e["pid"] for e in events} == {0, 1}
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    b = next(e for e in events if e["name"] == "1B0")
    assert b["dur"] == 2000  # 2 cost units, shown as 2 ms


def test_deadlock_is_reported() -> None:
    s = Schedule(1, 1, 1, ((schedules.Action.parse("0B0"), schedules.Action.parse("0F0")),))
    with pytest.raises(ScheduleError, match="deadlock"):
        schedules.simulate(s)


def test_timeline_json_errors() -> None:
    with pytest.raises(ScheduleError, match="not a pipeline timeline"):
        Timeline.from_json('{"format": "other"}')
    with pytest.raises(ScheduleError, match="malformed"):
        Timeline.from_json("{")


@pytest.mark.parametrize(("events", "num_ranks", "message"), [
    ([[1, "0F0", 0, 1]], 1, "outside 0..0"),
    ([[-1, "0F0", 0, 1]], 1, "on rank -1, outside"),
    ([[0, "0F0", 2, 1]], 1, "runs from 2.0 to 1.0"),
    ([[0, "0F0", 0, "nan"]], 1, "must be finite"),
    ([], 0, "num_ranks must be >= 1"),
])
def test_timeline_json_rejects_impossible_events(events: list[list[object]], num_ranks: int,
                                                  message: str) -> None:
    text = json.dumps({"format": "pipeline-timeline/1", "num_ranks": num_ranks,
                       "events": events})
    with pytest.raises(ScheduleError, match=message):
        Timeline.from_json(text)
