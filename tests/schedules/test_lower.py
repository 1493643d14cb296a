"""Lowering: one SEND and one RECV per cross-rank message, receives in each sender's order."""

from __future__ import annotations

import pytest
from hypothesis import given

import schedules
from schedules import Action, Op, Schedule, ScheduleError
from schedules.lower import consumed, message, produced, source_stage
from tests.strategies import schedules_any


def _channels(s: Schedule, ops: tuple[Op, Op]) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """Per (sender, receiver) pair, the messages of `ops` actions in row order."""
    out: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for row in s.actions:
        for a in row:
            if a.op in ops:
                msg = message(a)
                pair = (s.rank_of(source_stage(msg)), s.rank_of(msg[1]))
                out.setdefault(pair, []).append(msg)
    return out


@given(schedules_any())
def test_lowering_keeps_each_pairs_order_and_feeds_every_consumer(s: Schedule) -> None:
    lowered = schedules.lower(s)
    sent = _channels(lowered, (Op.SEND_F, Op.SEND_B))
    posted = _channels(lowered, (Op.RECV_F, Op.RECV_B))
    assert sent == posted  # same messages, same order, for every pair of ranks
    for rank, row in enumerate(lowered.actions):
        seen: set[tuple[str, int, int]] = set()
        for i, a in enumerate(row):
            if a.op in (Op.RECV_F, Op.RECV_B):
                seen.add(message(a))
            elif a.is_compute:
                needs = consumed(a, s.num_stages)
                if needs is not None and s.rank_of(source_stage(needs)) != rank:
                    assert needs in seen, f"{a} on rank {rank} before its RECV"
                gives = produced(a, s.num_stages)
                if gives is not None and s.rank_of(gives[1]) != rank:
                    assert message(row[i + 1]) == gives  # the SEND follows its producer
    assert lowered.compute_only() == s
    schedules.validate(lowered)
    assert schedules.simulate(lowered).makespan == schedules.simulate(s).makespan


def test_interleaved_odd_m_posts_the_gradient_before_the_later_activation() -> None:
    # p=2, m=5: rank 0 sends 2SEND_B0 (gradient for stage 1) before 0SEND_F3 (activations for
    # stage 1), while rank 1 needs 1F3 before 1B0. Receiving in consumer order would post the
    # activation's buffer first, and the gradient (same shape) would land in it.
    lowered = schedules.lower(schedules.get_schedule("interleaved", 2, 5))
    row = [str(a) for a in lowered.actions[1]]
    assert row.index("1RECV_B0") < row.index("1RECV_F3") < row.index("1F3") < row.index("1B0")
    zero = [str(a) for a in lowered.actions[0]]
    assert zero.index("2SEND_B0") < zero.index("0SEND_F3")


def test_out_of_order_receives_are_rejected_with_both_ends_marked() -> None:
    lowered = schedules.lower(schedules.get_schedule("gpipe", 2, 2))
    row = list(lowered.actions[1])
    a, b = row.index(Action(1, Op.RECV_F, 0)), row.index(Action(1, Op.RECV_F, 1))
    row[a], row[b] = row[b], row[a]
    # Move the second receive before the first consumer so only the order is wrong.
    bad = lowered.replace(actions=(lowered.actions[0], tuple(row)))
    with pytest.raises(ScheduleError, match="rank 1 posts receives from rank 0 out of order: "
                                            "message 0 rank 0 sends is activations for stage 1, "
                                            "micro-batch 0") as err:
        schedules.validate(bad)
    assert set(err.value.marks) == {0, 1}


def test_missing_and_stray_communication_is_rejected() -> None:
    lowered = schedules.lower(schedules.get_schedule("1f1b", 2, 1))
    rows = [list(r) for r in lowered.actions]
    no_send = [[a for a in rows[0] if a.op is not Op.SEND_F], rows[1]]
    with pytest.raises(ScheduleError, match="1F0 needs data from rank 0 but the schedule has no "
                                            "SEND for it on rank 0"):
        schedules.validate(lowered.replace(actions=tuple(map(tuple, no_send))))
    stray = [[*rows[0], Action(0, Op.SEND_B, 0)], rows[1]]
    with pytest.raises(ScheduleError, match=r"outside stages 0\.\.1"):
        schedules.validate(lowered.replace(actions=tuple(map(tuple, stray))))
    one_rank = schedules.get_schedule("interleaved", 1, 2)
    same = [[Action(0, Op.SEND_F, 0), *one_rank.actions[0]]]
    with pytest.raises(ScheduleError, match="both on rank 0; nothing crosses ranks"):
        schedules.validate(one_rank.replace(actions=tuple(map(tuple, same))))


def test_a_schedule_with_comms_is_returned_as_is() -> None:
    lowered = schedules.lower(schedules.get_schedule("zb-h1", 3, 4))
    assert schedules.lower(lowered) is lowered


def test_message_of_a_compute_action_is_an_error() -> None:
    with pytest.raises(ValueError, match="is not a SEND or RECV"):
        message(Action(0, Op.F, 0))
