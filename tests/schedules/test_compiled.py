"""The simulator's dependency graph is built once per schedule and kept: timing a schedule
again under other costs gives exactly the timeline an uncached build gives."""

import re
from collections.abc import Callable
from itertools import repeat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules
import schedules.graph
from schedules import Costs, Event, Schedule, Timeline, compiled
from schedules.graph import execute
from schedules.simulate import makespan
from tests.strategies import microbatch_costs, mutated_schedules, schedules_any, sync_programs


def _uncached(schedule: Schedule, costs: Costs) -> object:
    """`simulate`'s timeline (or error) from the graph built afresh by `graph.execute`."""
    try:
        result = execute(schedule, costs.of_action, costs.comm, edge=costs.edge)
    except (ValueError, IndexError) as exc:  # a cost missing for a stage
        return (type(exc), str(exc))
    if not isinstance(result, tuple):  # the simulator's report of it
        return ", ".join(f"rank {r} at step {i}" for r, (i, _) in sorted(result.blocked.items()))
    starts, ends = result
    events: list[Event] = []
    for r, row in enumerate(schedule.actions):
        events += map(Event, repeat(r), row, starts[r], ends[r])
    return tuple(events)


def _cached(schedule: Schedule, costs: Costs) -> object:
    try:
        timeline = schedules.simulate(schedule, costs)
    except schedules.ScheduleError as exc:
        found = re.search(r"deadlock \((.*)\); run", str(exc))
        if found is None:
            raise
        return found.group(1)
    except (ValueError, IndexError) as exc:
        return (type(exc), str(exc))
    return timeline.events


@settings(max_examples=150)
@given(st.data(), st.sampled_from(["plain", "lowered", "program", "mutated"]))
def test_the_kept_graph_times_exactly_as_a_fresh_build(data: st.DataObject, kind: str) -> None:
    strategy = {"plain": schedules_any(), "lowered": schedules_any().map(schedules.lower),
                "program": sync_programs(), "mutated": mutated_schedules()}[kind]
    schedule = data.draw(strategy)
    # One program, timed again and again under other costs, as the tokens cut times it.
    for _ in range(data.draw(st.integers(1, 4))):
        costs = data.draw(microbatch_costs(schedule))
        assert _cached(schedule, costs) == _uncached(schedule, costs)


def test_the_graph_is_built_once_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    program = schedules.program(schedules.get_schedule("1f1b", 2, 8), schedules.Syncs())
    built: list[Schedule] = []
    real: Callable[..., object] = schedules.graph.prerequisites

    def counted(schedule: Schedule) -> object:
        built.append(schedule)
        return real(schedule)

    monkeypatch.setattr(schedules.graph, "prerequisites", counted)
    spans = {schedules.simulate(program, Costs(microbatch=[1.0 + k % 3] * 3 + [0.5])).makespan
             for k in range(5)}
    assert len(spans) == 3  # timed under three different costs
    assert built == [program]  # the dependency graph built once, at the first call


def test_a_schedule_gone_leaves_no_graph_for_one_at_its_address() -> None:
    # Schedules built and dropped one after another: their objects' ids are reused, and the
    # kept graphs must never be taken for another schedule's.
    # Freed by their reference count alone: a full collection per schedule took two minutes
    # in the whole suite's process, and the ids come back without one.
    costs = Costs(comm=0.5, microbatch=(2.0, 1.0, 0.5))
    ids = []
    for k in range(60):
        schedule = schedules.get_schedule(["gpipe", "1f1b", "zb-h1"][k % 3], 2 + k % 3, 3 + k % 5)
        assert schedules.simulate(schedule, costs).events == _uncached(schedule, costs)
        ids.append(id(schedule))
        del schedule
    assert len(set(ids)) < len(ids)  # ids were reused: the case this test is about


def test_the_kept_graphs_are_bounded() -> None:
    costs = Costs(microbatch=(1.0, 2.0))
    for m in range(1, 3 * compiled.KEPT):
        schedules.simulate(schedules.get_schedule("gpipe", 2, m), costs)
    assert len(compiled.kept()) == compiled.KEPT


def test_a_timeline_timed_from_the_kept_graph_is_the_simulators() -> None:
    program = schedules.get_schedule("1f1b", 2, 3)
    costs = Costs(comm=0.25, microbatch=(3.0, 1.0, 2.0))
    first = schedules.simulate(program, costs)
    again = schedules.simulate(program, costs)
    assert isinstance(again, Timeline) and again == first
    # 1F0 waits for 0F0 (3) and the latency; 0B0 for 1B0 (6.25 + 6) and the latency; ...
    assert [(str(e.action), e.start) for e in again.lane(0)] == [
        ("0F0", 0.0), ("0F1", 3.0), ("0B0", 12.5), ("0F2", 18.5), ("0B1", 20.5), ("0B2", 27.0)]
    assert again.makespan == 31.0


@settings(max_examples=100)
@given(st.data(), st.sampled_from(["program", "mutated"]), st.booleans())
def test_makespan_is_the_timelines(data: st.DataObject, kind: str, scaled: bool) -> None:
    schedule = data.draw(sync_programs() if kind == "program" else mutated_schedules())
    costs = data.draw(microbatch_costs(schedule, scaled))

    def outcome(fn: Callable[[], float]) -> object:
        try:
            return fn()
        except (ValueError, IndexError) as exc:  # a deadlock, a cost missing for a stage
            return (type(exc), str(exc))

    want = outcome(lambda: schedules.simulate(schedule, costs).makespan)
    assert outcome(lambda: makespan(schedule, costs)) == want
