"""Plain-text forms of a schedule: the rank x step grid, and a line format that parses back."""

from __future__ import annotations

from schedules.ir import Action, Schedule, ScheduleError
from schedules.syncs import Syncs

__all__ = ["format_grid", "from_text", "to_text"]


def format_grid(schedule: Schedule, marks: dict[int, int] | None = None) -> str:
    """The rank x step grid; a cell in `marks` (rank -> step) is shown as `>cell<`."""
    marks = marks or {}
    # Room for the widest cell, plus ">...<" when a cell is marked, plus a space between cells.
    width = max([len(str(a)) for row in schedule.actions for a in row] + [3]) + 1
    width += 2 if marks else 0
    steps = max((len(row) for row in schedule.actions), default=0)
    lines = [
        f"{schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages "
        f"({schedule.placement}), {schedule.num_microbatches} micro-batches"
        + (f" x {schedule.num_batches} batches" if schedule.num_batches > 1 else "")
        + (f"; syncs: {schedule.syncs}" if schedule.syncs is not None else "")
    ]
    label = len(f"rank {schedule.num_ranks - 1}")
    lines.append("step".ljust(label) + " " + "".join(str(i).rjust(width) for i in range(steps)))
    for rank, row in enumerate(schedule.actions):
        cells = []
        for i, action in enumerate(row):
            text = str(action)
            cells.append((f">{text}<" if marks.get(rank) == i else text).rjust(width))
        if rank in marks and marks[rank] >= len(row):
            cells.append(">end<".rjust(width))
        lines.append(f"rank {rank}".ljust(label) + " " + "".join(cells))
    return "\n".join(lines)


def to_text(schedule: Schedule) -> str:
    """A header line (a program's syncs on a line of their own) and one line of actions per
    rank; `from_text` reads it back exactly."""
    head = [
        f"schedule name={schedule.name} ranks={schedule.num_ranks} stages={schedule.num_stages} "
        f"microbatches={schedule.num_microbatches} batches={schedule.num_batches} "
        f"placement={schedule.placement}"
    ]
    if schedule.syncs is not None:
        head.append(f"syncs: {schedule.syncs}")
    rows = [f"rank {r}: " + " ".join(str(a) for a in row) for r, row in enumerate(schedule.actions)]
    return "\n".join([*head, *rows]) + "\n"


def from_text(text: str) -> Schedule:
    """Parse the output of `to_text`."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines or not lines[0].startswith("schedule "):
        raise ScheduleError("schedule text must start with a 'schedule name=... ranks=...' line")
    try:
        fields = dict(item.split("=", 1) for item in lines[0].split()[1:])
        syncs = None
        body_lines = lines[1:]
        if body_lines and body_lines[0].startswith("syncs:"):
            syncs = Syncs.parse(body_lines[0][len("syncs:"):])
            body_lines = body_lines[1:]
        rows: list[tuple[Action, ...]] = []
        for r, line in enumerate(body_lines):
            prefix, _, body = line.partition(":")
            if prefix.strip() != f"rank {r}":
                raise ScheduleError(f"expected line 'rank {r}: ...', got {line!r}")
            rows.append(tuple(Action.parse(cell) for cell in body.split()))
        return Schedule(
            num_ranks=int(fields["ranks"]),
            num_stages=int(fields["stages"]),
            num_microbatches=int(fields["microbatches"]),
            num_batches=int(fields.get("batches", "1")),
            placement=fields.get("placement", "loop"),
            name=fields.get("name", "custom"),
            actions=tuple(rows),
            syncs=syncs,
        )
    except (KeyError, ValueError) as exc:
        if isinstance(exc, ScheduleError):
            raise
        raise ScheduleError(f"malformed schedule text header {lines[0]!r}: {exc}") from exc
