"""The step is the program: a Pipe exposes the program it runs, its timeline shows the syncs."""

from __future__ import annotations

import torch

import schedules
from pipeline import Pipe
from schedules import SYNC_OPS, Op, Syncs
from tests.models import lm_loss, tiny_lm
from viz.render_svg import render_svg
from viz.render_text import render_text


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 13, (6, 9), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def test_the_pipe_runs_its_program_and_the_timeline_shows_its_syncs() -> None:
    pipe = Pipe(tiny_lm(dropout=0.0), balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    x, y = _batch()
    pipe.step(x, y, lm_loss)
    program = pipe.program()
    assert program.syncs == Syncs.of([(0, [1])])  # wte (stage 0) tied to the head (stage 1)
    assert program == schedules.program(pipe._programs.schedule(2, 1), program.syncs)
    assert [str(a) for a in program.actions[0] if a.op in SYNC_OPS] == [
        "0SEND_T1", "0RECV_G1", "0TIE_ADD1"]
    assert [str(a) for a in program.actions[1] if a.op in SYNC_OPS] == [
        "1RECV_T0", "1TIE_SET0", "1SEND_G0"]
    timeline = pipe.last_timeline()
    ran = {(e.rank, e.action) for e in timeline.events}
    # Every action but the sends and receives is recorded where the program put it.
    assert ran == {(r, a) for r, row in enumerate(program.actions) for a in row
                   if a.op not in schedules.COMM_OPS}
    assert timeline.meta["syncs"] == "ties=0:1"
    # The tie's gradient reached the owner: the head's uses count in wte's gradient.
    assert pipe.program(train=False).syncs == Syncs.of([(0, [1])])
    assert {a.op for row in pipe.program(train=False).actions for a in row} & SYNC_OPS == {
        Op.SEND_T, Op.RECV_T, Op.TIE_SET}


def test_pipeviz_draws_the_program_of_a_pipe() -> None:
    pipe = Pipe(tiny_lm(dropout=0.0), balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    program = pipe.program()
    text = render_text(program, costs=schedules.Costs(tie=0.5))
    # 1RECV_T0 posted at 0, then 1TIE_SET0 once the tied weights arrive: two instant marks.
    assert "sync (ties, dp, scaler)" in text and "rank 1 |*.*.F0" in text
    svg = render_svg(program)
    assert 'class="action op-sync"' in svg and "sync (ties, dp, scaler)" in svg
    x, y = _batch()
    pipe.step(x, y, lm_loss)
    assert "sync (ties, dp, scaler)" in render_text(pipe.last_timeline())
