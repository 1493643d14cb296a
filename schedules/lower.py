"""Lowering: insert the SEND/RECV actions a compute-only schedule implies."""

from __future__ import annotations

from schedules.ir import Action, Op, Schedule

__all__ = ["lower"]


def lower(schedule: Schedule) -> Schedule:
    """Add point-to-point communication to a compute-only schedule.

    After F(s, m) whose next stage lives on another rank comes SEND_F(s, m); right before the
    consumer F(s + 1, m) comes RECV_F(s + 1, m). Likewise SEND_B(s, m) after the B or I of stage
    s > 0 and RECV_B(s - 1, m) before the consumer's B or I. Receives sit right before their
    consumer (so a rank blocks only when it truly needs the data); sends right after their
    producer (so data leaves as early as possible). A schedule that already has them is
    returned unchanged.
    """
    if schedule.has_comms:
        return schedule
    last = schedule.num_stages - 1
    rank_of = schedule.rank_of
    rows = []
    for rank, row in enumerate(schedule.actions):
        out: list[Action] = []
        for a in row:
            s, m = a.stage, a.microbatch
            if a.op is Op.F and s > 0 and rank_of(s - 1) != rank:
                out.append(Action(s, Op.RECV_F, m))
            elif a.op in (Op.B, Op.I) and s < last and rank_of(s + 1) != rank:
                out.append(Action(s, Op.RECV_B, m))
            out.append(a)
            if a.op is Op.F and s < last and rank_of(s + 1) != rank:
                out.append(Action(s, Op.SEND_F, m))
            elif a.op in (Op.B, Op.I) and s > 0 and rank_of(s - 1) != rank:
                out.append(Action(s, Op.SEND_B, m))
        rows.append(tuple(out))
    return schedule.replace(actions=tuple(rows))
