"""Layout: boxes and gaps from timelines and schedules, failures located on the grid."""

from __future__ import annotations

import pytest
from hypothesis import given

import schedules
from schedules import Action, Costs, Event, Op, Schedule, Timeline
from tests.strategies import schedules_any
from viz.layout import format_costs, format_number, kind_of, layout, nice_ticks, time_scale


def _swap_first_two(schedule: Schedule, rank: int) -> Schedule:
    rows = [list(row) for row in schedule.actions]
    rows[rank][0], rows[rank][2] = rows[rank][2], rows[rank][0]
    return schedule.replace(actions=tuple(tuple(row) for row in rows))


def test_boxes_follow_the_simulation() -> None:
    lay = layout(schedules.get_schedule("1f1b", 2, 2))
    # rank 0: F0 [0,1] F1 [1,2], B0 waits for rank 1's B0 (ends 4): [4,6], B1 [7,9].
    assert [(str(b.action), b.start, b.end) for b in lay.lanes[0].boxes] == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 7, 9)]
    assert lay.lanes[0].gaps == ((2, 4), (6, 7))
    assert lay.lanes[1].gaps == ((0, 1), (7, 9))
    assert lay.makespan == 9 and lay.unit == "cost" and lay.failure is None
    assert [ln.bubble for ln in lay.lanes] == [pytest.approx(3 / 9)] * 2
    assert [ln.peak for ln in lay.lanes] == [2, 1]
    assert lay.kinds == ("F", "B")


@given(schedules_any())
def test_gaps_and_boxes_tile_each_lane(schedule: Schedule) -> None:
    lay = layout(schedule)
    for lane in lay.lanes:
        busy = sum(b.end - b.start for b in lane.boxes if b.kind != "comm")
        idle = sum(end - start for start, end in lane.gaps)
        assert busy + idle == pytest.approx(lay.makespan)
        assert lane.bubble == pytest.approx(idle / lay.makespan)
        assert [b.step for b in lane.boxes] == list(range(len(lane.boxes)))
        assert [b.action for b in lane.boxes] == list(schedule.actions[lane.rank])


def test_interleaved_boxes_know_their_chunk() -> None:
    lay = layout(schedules.get_schedule("interleaved", 2, 2, stages_per_rank=2))
    assert lay.stages_per_rank == 2
    chunks = {(b.action.stage, b.chunk) for b in lay.lanes[1].boxes}
    assert chunks == {(1, 0), (3, 1)}  # rank 1 holds stages 1 and 3


def test_measured_timeline_keeps_its_times_and_shifts_negative_starts() -> None:
    events = (Event(0, Action(0, Op.F, 0), -0.5, 0.5), Event(1, Action(1, Op.F, 0), 1.0, 2.0))
    lay = layout(Timeline(2, events, "s", {"schedule": "run"}))
    assert lay.title == "run" and lay.unit == "s" and "measured" in lay.subtitle
    assert (lay.lanes[0].boxes[0].start, lay.lanes[0].boxes[0].end) == (0.0, 1.0)
    assert lay.makespan == 2.5
    assert lay.lanes[0].gaps == ((1.0, 2.5),)


def test_deadlock_is_marked_and_laid_out_step_by_step() -> None:
    bad = _swap_first_two(schedules.get_schedule("1f1b", 2, 2), 0)  # 0B0 first: a deadlock
    lay = layout(bad)
    assert lay.failure is not None and lay.unit == "step" and lay.bubble is None
    assert "deadlock" in lay.failure.message
    assert "rank 0" not in lay.failure.message.splitlines()[0]
    assert ">" not in lay.failure.message  # the validator's grid is stripped; we draw our own
    assert {(m.rank, m.step) for m in lay.failure.marks} == {(0, 0), (1, 0)}
    assert [(b.start, b.end) for b in lay.lanes[0].boxes] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_a_duplicate_is_marked_on_the_simulated_timeline() -> None:
    s = schedules.get_schedule("gpipe", 2, 2)
    row = s.actions[0]
    lay = layout(s.replace(actions=((*row[:2], row[1], *row[2:]), s.actions[1])))
    assert lay.failure is not None and lay.unit == "cost"  # it still runs, so it is timed
    assert "appears more than once" in lay.failure.message
    (mark,) = lay.failure.marks
    assert (mark.rank, mark.step) == (0, 2)
    box = lay.lanes[0].boxes[2]
    assert (mark.start, mark.end) == (box.start, box.end)


def test_untimed_failure_without_a_single_step() -> None:
    s = schedules.get_schedule("1f1b", 2, 2)
    lay = layout(s.replace(actions=(s.actions[0], s.actions[1][:-1])))
    assert lay.failure is not None and lay.failure.marks == ()
    assert lay.failure.message.startswith("missing backward for stage 1 micro-batch 1")
    assert "rank 0" not in lay.failure.message  # the grid is ours to draw


def test_failure_marks_a_slot_past_the_end() -> None:
    from viz.layout import _with_failure

    base = layout(schedules.get_schedule("gpipe", 2, 1))
    lay = _with_failure(base, "stopped", {0: 2})
    (mark,) = lay.failure.marks if lay.failure else ()
    assert mark.start == base.lanes[0].boxes[-1].end == base.makespan
    assert lay.span > lay.makespan == base.makespan


def test_helpers() -> None:
    assert [kind_of(op) for op in Op] == ["F", "B", "I", "W", "U", "comm", "comm", "comm", "comm",
                                          *["sync"] * 9]
    assert format_number(33.0) == "33" and format_number(0.125) == "0.125"
    assert format_number(-0.0001) == "0"
    assert format_costs(Costs(forward=(1, 2), comm=0.1), ("F",)) == "F=1/2 comm=0.1"
    assert nice_ticks(33, 4) == [0, 10, 20, 30]
    assert nice_ticks(4, 10, whole=True) == [0, 1, 2, 3, 4]
    assert nice_ticks(0, 5) == [0]
    assert time_scale("s", 0.2) == (1e3, "ms")
    assert time_scale("s", 2e-4) == (1e6, "us")
    assert time_scale("s", 3) == (1.0, "s")
    assert time_scale("cost", 3) == (1.0, "cost units")


def test_sync_boxes_are_labelled_and_no_bubble() -> None:
    program = schedules.program(schedules.get_schedule("1f1b", 2, 2),
                                schedules.Syncs.of([(0, [1])], dp=True))
    lay = layout(program, costs=Costs(reduce_grad=1.0))
    labels = {b.label for lane in lay.lanes for b in lane.boxes if b.kind == "sync"}
    assert labels == {"St1", "Rt0", "Ts0", "Rd0", "Rd1", "Aw", "Sg0", "Rg1", "Ta1"}
    plain = layout(schedules.lower(schedules.get_schedule("1f1b", 2, 2)))
    # A background reduction is not work: the bubbles end where the plain schedule's do.
    assert lay.lanes[1].gaps[:-1] == plain.lanes[1].gaps[:-1]
    assert "sync" in lay.kinds
