"""A step's program: syncs placed by lowering, validated, simulated, drawn, written and read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedules
from schedules import (
    SYNC_OPS,
    Action,
    Costs,
    Op,
    Schedule,
    ScheduleError,
    Syncs,
    dumps_csv,
    from_text,
    get_schedule,
    loads_csv,
    lower,
    program,
    simulate,
    to_text,
    validate,
)
from tests.strategies import sync_programs

SYNCS = Syncs.of([(0, [1])], dp=True, scaler=True)


def _rows(text: str) -> tuple[tuple[Action, ...], ...]:
    """Rows of a table, a rank per unindented line (an indented line goes on)."""
    rows: list[list[Action]] = []
    for line in text.strip("\n").split("\n"):
        if line.startswith("            ") and rows:
            rows[-1] += [Action.parse(c) for c in line.split()]
        elif line.strip():
            rows.append([Action.parse(c) for c in line.split()])
    return tuple(tuple(r) for r in rows)


def test_a_program_written_out() -> None:
    """1F1B on 2 ranks, 2 micro-batches, stage 1 holding a copy of stage 0's weight, dp and a
    scaler: refresh first, reductions after each stage's last backward, ties after the wait."""
    got = program(get_schedule("1f1b", 2, 2), SYNCS)
    assert got.actions == _rows("""
        0SEND_T1 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD0
            0AWAIT_GRAD0 0RECV_G1 0TIE_ADD1 0OVERFLOW0
        1RECV_T0 1RECV_F0 1TIE_SET0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD0
            1AWAIT_GRAD0 1SEND_G0 1OVERFLOW0
    """)
    assert got.syncs == SYNCS
    validate(got)


def test_plain_lowering_is_unchanged() -> None:
    plain = get_schedule("zb-h1", 3, 4)
    assert program(plain, Syncs()) == lower(plain).replace(syncs=Syncs())
    assert lower(plain).syncs is None and not any(
        a.op in SYNC_OPS for row in lower(plain).actions for a in row)


def test_copies_on_the_owners_rank_need_no_message() -> None:
    got = program(get_schedule("interleaved", 2, 2, stages_per_rank=2), Syncs.of([(0, [2, 3])]))
    ops = [str(a) for a in got.actions[0] if a.op in SYNC_OPS]
    assert ops == ["0SEND_T3", "2TIE_SET0", "0RECV_G3", "0TIE_ADD2", "0TIE_ADD3"]
    assert [str(a) for a in got.actions[1] if a.op in SYNC_OPS] == [
        "3RECV_T0", "3TIE_SET0", "3SEND_G0"]
    validate(got)


def test_forward_only_refreshes_ties_alone() -> None:
    fwd = get_schedule("gpipe", 2, 2).compute_only()
    fwd = fwd.replace(actions=tuple(tuple(a for a in row if a.op is Op.F) for row in fwd.actions))
    got = program(fwd, SYNCS)
    assert {a.op for row in got.actions for a in row} & SYNC_OPS == {
        Op.SEND_T, Op.RECV_T, Op.TIE_SET}
    assert simulate(got).makespan == 3  # runs (a forward-only schedule does not validate)


@given(sync_programs())
def test_every_generator_with_random_syncs_validates_and_simulates(p: Schedule) -> None:
    validate(p)
    plain = simulate(p.compute_only())
    timeline = simulate(p)
    assert timeline.makespan == pytest.approx(plain.makespan)  # syncs cost 0 by default
    assert from_text(to_text(p)) == p
    assert loads_csv(dumps_csv(p, dialect="ours"), num_microbatches=p.num_microbatches,
                     name=p.name, placement=p.placement).actions == p.actions


@given(sync_programs(), st.data())
def test_a_dropped_or_moved_sync_is_rejected_with_the_grid(p: Schedule, data: st.DataObject
                                                           ) -> None:
    """Any sync dropped, or one that waits for something moved to its rank's start."""
    where = [(r, i) for r, row in enumerate(p.actions) for i, a in enumerate(row)
             if a.op in SYNC_OPS]
    if not where:
        return
    rank, i = data.draw(st.sampled_from(where))
    row = list(p.actions[rank])
    a = row.pop(i)
    # Sends of tied weights open their rows, and a posted receive may go first where no
    # other message comes from its peer: moving those can be legal.
    local = a.op is Op.TIE_SET and p.rank_of(a.microbatch) == rank  # waits for nothing
    if a.op not in (Op.SEND_T, Op.RECV_T, Op.RECV_G) and not local and data.draw(st.booleans()):
        row.insert(0, a)
    rows = list(p.actions)
    rows[rank] = tuple(row)
    with pytest.raises(ScheduleError) as info:
        validate(p.replace(actions=tuple(rows)))
    assert info.value.marks and "\nstep " in str(info.value)  # the grid, a step marked


def test_rules_name_what_is_wrong() -> None:
    p = program(get_schedule("1f1b", 2, 2), SYNCS)
    rows = [list(r) for r in p.actions]
    rows[1].remove(Action(1, Op.TIE_SET, 0))
    with pytest.raises(ScheduleError, match="rank 1 takes no part"):
        validate(p.replace(actions=tuple(map(tuple, rows))))
    rows = [list(r) for r in p.actions]
    rows[0].remove(Action(0, Op.OVERFLOW, 0))
    rows[0].insert(3, Action(0, Op.OVERFLOW, 0))
    with pytest.raises(ScheduleError, match="must be rank 0's last action"):
        validate(p.replace(actions=tuple(map(tuple, rows))))
    rows = [list(r) for r in p.actions]
    rows[1].remove(Action(1, Op.AWAIT_GRAD, 0))
    rows[1].insert(rows[1].index(Action(1, Op.REDUCE_GRAD, 0)), Action(1, Op.AWAIT_GRAD, 0))
    with pytest.raises(ScheduleError, match="1AWAIT_GRAD0 comes before 1REDUCE_GRAD0"):
        validate(p.replace(actions=tuple(map(tuple, rows))))


def test_simulated_costs() -> None:
    """Costs of the syncs: the tie transfer delays the copy's first forward, the reductions run
    beside the work from their launch, one after another, and the wait ends with the last."""
    p = program(get_schedule("gpipe", 2, 1), SYNCS)
    base = simulate(p).makespan  # F=1, B=2: 0F0 1F0 1B0 0B0 = 6
    assert base == 6
    t = simulate(p, Costs(tie=1.5, reduce_grad=(3.0, 0.25), overflow=0.5))
    end = {(e.rank, str(e.action)): (e.start, e.end) for e in t.events}
    assert end[(1, "1F0")] == (1.5, 2.5)  # waits for the tied weights (1.5), not 0F0 (1)
    assert end[(1, "1REDUCE_GRAD0")] == (4.5, 4.75)
    assert end[(0, "0REDUCE_GRAD0")] == (6.5, 9.5)  # launched after 0B0 ends at 6.5
    assert end[(0, "0TIE_ADD1")][0] == 9.5  # after the wait (the gradients came at 6.25)
    assert t.makespan == 10.0  # then the agreement, 0.5 on both ranks together
    assert end[(1, "1OVERFLOW0")] == (9.5, 10.0)
    assert Costs.parse("tie=0.5,REDUCE_GRAD=2,OVERFLOW=1") == Costs(tie=0.5, reduce_grad=2.0,
                                                                     overflow=1.0)


def test_action_text_stays_out_of_torchs_grammar() -> None:
    import re

    torch_action = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|"
                              r"RECV_B)(\d*)")  # torch 2.13's _action_regex, read with .match
    for op in SYNC_OPS:
        text = str(Action(1, op, 0))
        assert Action.parse(text) == Action(1, op, 0)
        hit = torch_action.match(text)
        assert hit is None or (op is Op.REDUCE_GRAD and hit.group(2) == "REDUCE_GRAD")
    p = program(get_schedule("1f1b", 2, 2), SYNCS)
    with pytest.raises(ScheduleError, match="program with syncs"):
        dumps_csv(p)
    assert schedules.Syncs.parse(str(SYNCS)) == SYNCS


def test_the_last_gradient_action_of_each_stage() -> None:
    """Where REDUCE_GRAD goes: after each stage's last B, W (or U) of the rank's row."""
    from schedules.program import _last_gradients

    row = (Action(0, Op.F, 0), Action(1, Op.F, 0), Action(1, Op.B, 0), Action(0, Op.I, 0),
           Action(1, Op.B, 1), Action(0, Op.W, 0))
    assert _last_gradients(row) == {1: 4, 0: 5}
