"""Schedules as CSV in torch.distributed.pipelining's format: one row per rank, cells like `0F1`."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable

from schedules.ir import Action, Op, Schedule, ScheduleError

__all__ = ["dump_csv", "dumps_csv", "load_csv", "loads_csv"]

_PLACEMENTS = ("loop", "v")


def dumps_csv(schedule: Schedule) -> str:
    """One row per rank; a cell per action (with SEND/RECV if the schedule has them)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in schedule.actions:
        writer.writerow([str(a) for a in row])
    return buffer.getvalue()


def dump_csv(schedule: Schedule, path: str | os.PathLike[str]) -> None:
    """Write `schedule` in torch's CSV format (compute-only, or with comms if lowered)."""
    with open(path, "w", newline="") as f:
        f.write(dumps_csv(schedule))


def loads_csv(text: str, *, num_microbatches: int | None = None, name: str = "csv",
              placement: str | None = None) -> Schedule:
    """Parse torch's CSV format. Empty cells (idle steps) are dropped.

    Ranks are the rows; the stage count and micro-batch count are inferred from the actions
    (pass `num_microbatches` for a multi-batch schedule); the placement is whichever of `loop`
    and `v` puts every action on its row's rank.
    """
    rows: list[tuple[Action, ...]] = []
    for r, cells in enumerate(csv.reader(io.StringIO(text))):
        actions = []
        for c, cell in enumerate(cells):
            if not cell.strip():
                continue
            try:
                actions.append(Action.parse(cell))
            except ScheduleError as exc:
                raise ScheduleError(f"row {r} (rank {r}), column {c}: {exc}") from None
        rows.append(tuple(actions))
    while rows and not rows[-1]:
        rows.pop()  # a trailing blank line is not a rank
    if not rows:
        raise ScheduleError("the CSV holds no actions")
    all_actions = [a for row in rows for a in row]
    num_ranks = len(rows)
    num_stages = max(a.stage for a in all_actions) + 1
    if num_stages % num_ranks:
        num_stages += num_ranks - num_stages % num_ranks
    total = max(a.microbatch for a in all_actions if a.op is not Op.U) + 1
    per_batch = num_microbatches or total
    batches = max([total // per_batch] + [a.microbatch + 1 for a in all_actions if a.op is Op.U])
    candidates = (placement,) if placement else _PLACEMENTS
    for place in candidates:
        schedule = Schedule(num_ranks, num_stages, per_batch, tuple(rows), place, batches, name)
        if _placed(schedule, enumerate(rows)):
            return schedule
    raise ScheduleError(
        f"no placement puts every stage on the rank of its row ({', '.join(candidates)} tried): "
        f"each stage must appear on exactly one row"
    )


def load_csv(path: str | os.PathLike[str], **kwargs: object) -> Schedule:
    """Read a schedule CSV written by `dump_csv` or by torch's `_dump_csv`."""
    with open(path, newline="") as f:
        return loads_csv(f.read(), **kwargs)  # type: ignore[arg-type]


def _placed(schedule: Schedule, rows: Iterable[tuple[int, tuple[Action, ...]]]) -> bool:
    return all(schedule.rank_of(a.stage) == r for r, row in rows for a in row)
