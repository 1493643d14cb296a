"""The validator's rules for a program's syncs: each where it belongs, on every rank it concerns.

Beside the rules every schedule keeps (actions in range and on their rank, one SEND and one RECV
per message, receives in each sender's order, no deadlock: `schedules.validate`), a program
must carry out what its `syncs` ask for: the very sync actions `schedules.program` would place
(a missing one means a rank that owns or copies a tie, or reduces gradients, takes no part), each
after what it waits for on its own rank (a copy's forward after its refresh, a reduction after
the stage's last gradient action, a tie's gradient after the dp average, the owner's adds in
copy order), and the overflow agreement last on every rank. Waits across ranks are the deadlock
check's: the collective's and the tie messages' included.
"""

from __future__ import annotations

from collections import Counter

from schedules.ir import SYNC_OPS, Action, Op, Schedule, ScheduleError
from schedules.program import infer, program, sync_prerequisites
from schedules.text import format_grid

__all__ = ["check_syncs", "describe_sync"]

_WHY = {
    Op.F: "a copy stage computes with its tied weights only once they are refreshed",
    Op.TIE_SET: "the copy takes its owner's values from the receive it posted",
    Op.SEND_G: "a copy's gradients leave once final (after its last gradient action, and "
               "after the dp average)",
    Op.TIE_ADD: "the owner adds a copy's gradients once its own are final (after its last "
                "gradient action, and after the dp average), copies in increasing stage order",
    Op.REDUCE_GRAD: "a stage's gradients are reduced once final, after its last B, W or U",
    Op.AWAIT_GRAD: "the wait comes after every REDUCE_GRAD of its rank",
}


def _fail(schedule: Schedule, message: str, marks: dict[int, int]) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, marks)}", reason=message,
                         marks=marks)


def check_syncs(schedule: Schedule) -> None:
    """Raise `ScheduleError` (with the grid marked) where the syncs break a rule above."""
    syncs = schedule.syncs if schedule.syncs is not None else infer(schedule)
    want = program(schedule.replace(syncs=None), syncs)  # the same actions, syncs placed anew
    for rank, (row, expected) in enumerate(zip(schedule.actions, want.actions, strict=True)):
        have = Counter(a for a in row if a.op in SYNC_OPS)
        need = Counter(a for a in expected if a.op in SYNC_OPS)
        for a in need - have:
            raise _fail(schedule, f"rank {rank} takes no part in the step's syncs ({syncs}): "
                        f"it lacks {a} ({describe_sync(a)})", {rank: len(row)})
        for i, a in enumerate(row):
            if a in have - need:
                raise _fail(schedule, f"{a} ({describe_sync(a)}) is not one of the syncs "
                            f"{syncs} asks of rank {rank}", {rank: i})
    present = {(a.stage, a.op, a.microbatch) for row in schedule.actions for a in row}
    deps = sync_prerequisites(schedule, syncs, present)
    for rank, row in enumerate(schedule.actions):
        at = {(a.stage, a.op, a.microbatch): i for i, a in enumerate(row)}
        for i, a in enumerate(row):
            if a.op not in SYNC_OPS and a.op is not Op.F:
                continue
            if a.op is Op.OVERFLOW and i != len(row) - 1:
                raise _fail(schedule, f"{a} ({describe_sync(a)}) must be rank {rank}'s last "
                            f"action: every gradient of the step counts, and every rank "
                            f"takes part", {rank: i})
            for key in deps(a):
                j = at.get(key)
                if j is not None and j > i:
                    s, op, m = key
                    raise _fail(schedule, f"{a} comes before {s}{op.value}{m} on rank {rank}: "
                                f"{_WHY.get(a.op, 'it waits for it')}", {rank: i})


def describe_sync(a: Action) -> str:
    """What a sync action does, in words (for error messages)."""
    s, m = a.stage, a.microbatch
    return {
        Op.SEND_T: f"stage {s} sends its tied weights to stage {m}",
        Op.RECV_T: f"stage {s} posts the receive of stage {m}'s tied weights",
        Op.TIE_SET: f"stage {s} takes stage {m}'s tied weights",
        Op.SEND_G: f"stage {s} sends its tied weights' gradients to stage {m}",
        Op.RECV_G: f"stage {s} posts the receive of stage {m}'s tied gradients",
        Op.TIE_ADD: f"stage {s} adds stage {m}'s tied gradients",
        Op.REDUCE_GRAD: f"stage {s} launches its gradients' all-reduce over dp",
        Op.AWAIT_GRAD: "the rank waits for its gradient all-reduces",
        Op.OVERFLOW: "the ranks agree on the scaler's overflow",
    }.get(a.op, str(a))
