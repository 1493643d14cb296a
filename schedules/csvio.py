"""Schedules as CSV in torch.distributed.pipelining's format: one row per rank, cells like `0F1`."""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterable, Sequence

from schedules.files import read_file, write_atomic
from schedules.ir import SYNC_OPS, Action, Op, Schedule, ScheduleError
from schedules.program import infer

__all__ = ["DIALECTS", "MAX_CSV_BYTES", "dump_csv", "dumps_csv", "load_csv", "loads_csv",
           "torch_incompatibility"]

_PLACEMENTS = ("loop", "v")
DIALECTS = ("torch", "ours")
MAX_CSV_BYTES = 64 << 20  # a schedule of millions of actions; a larger file is no schedule
_PLURAL = {"stage": "stages", "micro-batch": "micro-batches", "batch": "batches"}

# Cells torch writes that carry nothing our runtime needs (see `loads_csv`), and DualPipeV's
# overlapped pair: "(0F3;3B1)OVERLAP_F_B" runs 0F3, then 3B1.
# (Torch writes REDUCE_GRAD with no index; our programs' `0REDUCE_GRAD0` is an action.)
_DROPPED = re.compile(r"^\d+((UNSHARD|RESHARD)\d*|REDUCE_GRAD)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def torch_incompatibility(schedule: Schedule) -> str | None:
    """Why torch 2.13's `_PipelineScheduleRuntime` cannot run `schedule` (None: it can).

    Torch's action grammar has F, B, I, W and SEND/RECV, one batch per step and one set of
    weights; it has no weight update inside a schedule and no weight versions (PipeDream-2BW).
    """
    actions = [a for row in schedule.actions for a in row]
    synced = next((a for a in actions if a.op in SYNC_OPS), None)
    if synced is not None:
        return (f"it is a program with syncs (e.g. {synced}): tied weights, dp reductions and "
                f"the scaler's agreement are ours; torch's REDUCE_GRAD scales gradients instead")
    if any(a.op is Op.U for a in actions):
        return ("it updates weights inside the schedule (U actions); torch.distributed."
                "pipelining has no update action")
    versioned = next((a for a in actions if a.version is not None), None)
    if versioned is not None:
        bare = Action(versioned.stage, versioned.op, versioned.microbatch)
        return (f"its actions carry weight versions (e.g. {versioned}), which torch's action "
                f"grammar lacks (it would read {versioned} as {bare})")
    if schedule.num_batches > 1:
        return (f"it runs {schedule.num_batches} batches without a flush; torch runs one "
                f"batch per step")
    return None


def _torch_rows(schedule: Schedule) -> list[list[str]]:
    """Torch's dialect: the same cells, plus, in a lowered schedule, a `<stage>REDUCE_GRAD` after
    each stage's last backward (B or W) and the SENDs that follow it, where torch's own
    lowering (`_add_reduce_grad`) puts it. Torch's runtime scales the gradients by 1/m there,
    and only there: without it every gradient is m times too large. A compute-only schedule
    gets none (torch's compute-only loader adds its own and refuses any non-compute cell)."""
    reason = torch_incompatibility(schedule)
    if reason is not None:
        raise ScheduleError(
            f"cannot write {schedule.name!r} in torch's dialect: {reason}. Write it with "
            f"dialect='ours' (our own runtime and loads_csv read it), or choose a schedule "
            f"without weight versions"
        )
    rows = []
    for row in schedule.actions:
        last = {a.stage: i for i, a in enumerate(row) if a.op in (Op.B, Op.W)}
        after: dict[int, list[str]] = {}
        if schedule.has_comms:
            for stage, i in last.items():
                while i + 1 < len(row) and row[i + 1].op in (Op.SEND_F, Op.SEND_B):
                    i += 1
                after.setdefault(i, []).append(f"{stage}REDUCE_GRAD")
        cells = []
        for i, a in enumerate(row):
            cells.append(str(a))
            cells += after.get(i, ())
        rows.append(cells)
    return rows


def dumps_csv(schedule: Schedule, *, dialect: str = "torch") -> str:
    """One row per rank, a cell per action (SEND/RECV too if the schedule is lowered).

    `dialect="torch"` (the default) writes what torch 2.13's `_PipelineScheduleRuntime` trains
    with (`_load_csv(path, format="compute_comms")` for a schedule with SEND/RECV actions,
    `"compute_only"` for one without: compute-only, or lowered on one rank), and refuses a
    schedule it cannot run (see `torch_incompatibility`);
    `dialect="ours"` writes the actions as they are, weight versions and updates included.
    `loads_csv` reads both back to the same schedule.
    """
    if dialect not in DIALECTS:
        raise ScheduleError(f"dialect must be one of {DIALECTS} (got {dialect!r})")
    rows = (_torch_rows(schedule) if dialect == "torch"
            else [[str(a) for a in row] for row in schedule.actions])
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows(rows)
    return buffer.getvalue()


def dump_csv(schedule: Schedule, path: str | os.PathLike[str], *, dialect: str = "torch") -> None:
    """Write `schedule` to `path` as `dumps_csv` does."""
    write_atomic(path, dumps_csv(schedule, dialect=dialect))


def _cell_actions(cell: str) -> tuple[Action, ...]:
    text = cell.strip()
    if not text or _DROPPED.match(text):
        return ()
    overlap = _OVERLAP.match(text)
    if overlap is not None:
        return tuple(Action.parse(part) for part in overlap.group(1).split(";") if part.strip())
    return (Action.parse(text),)


def loads_csv(text: str, *, num_microbatches: int | None = None, name: str = "csv",
              placement: str | None = None) -> Schedule:
    """Parse a schedule CSV: ours (either dialect) or any torch 2.13 writes.

    Empty cells (idle steps) are dropped. So are torch's `UNSHARD`/`RESHARD` (FSDP's gather
    and release of a stage's sharded parameters: our stages are never sharded) and
    `REDUCE_GRAD` (where torch scales the summed micro-batch gradients by 1/m: our runtime
    weights each micro-batch's loss instead, so its gradients need no step of their own).
    DualPipeV's overlapped cells, `(0F3;3B1)OVERLAP_F_B`, become their actions in order.

    Ranks are the rows; the stage count and micro-batch count are inferred from the actions
    (pass `num_microbatches` for a multi-batch schedule); the placement is whichever of `loop`
    and `v` puts every action on its row's rank.
    """
    rows: list[tuple[Action, ...]] = []
    cells_read: list[tuple[str, tuple[Action, ...]]] = []  # (where, actions) per non-idle cell
    try:
        for r, cells in enumerate(csv.reader(io.StringIO(text))):
            actions: list[Action] = []
            for c, cell in enumerate(cells):
                where = f"row {r} (rank {r}), column {c}"
                try:
                    parsed = _cell_actions(cell)
                except ScheduleError as exc:
                    raise ScheduleError(f"{where}: {exc}") from None
                actions += parsed
                if parsed:
                    cells_read.append((where, parsed))
            rows.append(tuple(actions))
    except csv.Error as exc:
        raise ScheduleError(f"cannot read the CSV: {exc}; a schedule CSV has one row per rank "
                            f"and short cells like 0F1") from None
    while rows and not rows[-1]:
        rows.pop()  # a trailing blank line is not a rank
    if not rows:
        raise ScheduleError("the CSV holds no actions")
    all_actions = [a for row in rows for a in row]
    _check_indices(cells_read, len(all_actions))
    num_ranks = len(rows)
    num_stages = max(a.stage for a in all_actions) + 1
    if num_stages % num_ranks:
        num_stages += num_ranks - num_stages % num_ranks
    total = max(a.microbatch for a in all_actions
                if a.op is not Op.U and a.op not in SYNC_OPS) + 1
    per_batch = num_microbatches or total
    batches = max([total // per_batch] + [a.microbatch + 1 for a in all_actions if a.op is Op.U])
    candidates = (placement,) if placement else _PLACEMENTS
    for place in candidates:
        schedule = Schedule(num_ranks, num_stages, per_batch, tuple(rows), place, batches, name)
        if _placed(schedule, enumerate(rows)):
            if any(a.op in SYNC_OPS for a in all_actions):  # a program: its syncs
                return schedule.replace(syncs=infer(schedule))
            return schedule
    raise ScheduleError(
        f"no placement puts every stage on the rank of its row ({', '.join(candidates)} tried): "
        f"{_misplaced(cells_read, num_ranks, num_stages, per_batch, candidates)}"
    )


def load_csv(path: str | os.PathLike[str], **kwargs: object) -> Schedule:
    """Read a schedule CSV written by `dump_csv` or by torch's `_dump_csv` (see `loads_csv`),
    through the file gate (`schedules.files`: a regular file, no link another user planted,
    at most `MAX_CSV_BYTES`)."""
    data = read_file(path, limit=MAX_CSV_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScheduleError(
            f"{os.fspath(path)} is not a text CSV: byte {exc.start} is not UTF-8 "
            f"({exc.reason}); a schedule CSV is UTF-8 text with one row per rank and cells "
            f"like 0F1 (written by dump_csv or torch's _dump_csv)"
        ) from None
    return loads_csv(text, **kwargs)  # type: ignore[arg-type]


def _check_indices(cells: list[tuple[str, tuple[Action, ...]]], num_actions: int) -> None:
    """Every stage has a forward of every micro-batch, so a CSV of n actions holds fewer than
    n stages and n micro-batches; a larger index is a typo, and would size the schedule's
    tables (a stage of 10**9: a placement table of 10**9 entries)."""
    for where, actions in cells:
        for a in actions:
            batch = "batch" if a.op is Op.U else "micro-batch"  # U's index is its batch
            for what, index in (("stage", a.stage), (batch, a.microbatch)):
                if index >= num_actions:
                    raise ScheduleError(
                        f"{where}: {what} {index} in '{a}' is out of range: the CSV holds "
                        f"{num_actions} action{'s' if num_actions != 1 else ''}, and every "
                        f"stage needs a forward of every micro-batch, so its {_PLURAL[what]} are "
                        f"numbered 0 to {num_actions - 1} at most; number them from 0 "
                        f"without gaps"
                    )


def _misplaced(cells: list[tuple[str, tuple[Action, ...]]], num_ranks: int, num_stages: int,
               num_microbatches: int, candidates: Sequence[str]) -> str:
    """The first action that sits on the wrong row, where it is, and where it belongs."""
    first: dict[int, tuple[int, str, Action]] = {}  # stage -> (row, where, action) first seen
    for where, actions in cells:
        row = int(where.split()[1])
        for a in actions:
            seen = first.setdefault(a.stage, (row, where, a))
            if seen[0] != row:
                return (f"{where}: '{a}' puts stage {a.stage} on rank {row}, but row {seen[0]} "
                        f"({seen[1].split(', ')[1]}: '{seen[2]}') puts it on rank {seen[0]}; "
                        f"each stage runs on one rank: move '{a}' to row {seen[0]}")
    for stage, (row, where, a) in first.items():  # in the order the CSV reads
        homes = {p: Schedule(num_ranks, num_stages, num_microbatches, ((),) * num_ranks,
                             p).rank_of(stage) for p in candidates}
        if row not in homes.values():
            said = " and ".join(f"{'placement ' if i == 0 else ''}{p!r} on rank {r}"
                                for i, (p, r) in enumerate(homes.items()))
            said = said.replace(" on rank", " puts it on rank", 1)
            return (f"{where}: '{a}' puts stage {stage} on rank {row}, but {said}; move its "
                    f"actions to that row (rows are ranks; stage s is on rank s mod p, or on "
                    f"ranks 0..p-1 and back for 'v')")
    return "each stage must appear on exactly one row"


def _placed(schedule: Schedule, rows: Iterable[tuple[int, tuple[Action, ...]]]) -> bool:
    return all(schedule.rank_of(a.stage) == r for r, row in rows for a in row)
