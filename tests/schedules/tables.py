"""Helper: a schedule as one line of compact actions per rank, for hand-written expected tables."""

from __future__ import annotations

import schedules

__all__ = ["rows"]


def rows(name: str, num_ranks: int, num_microbatches: int, **options: int) -> list[str]:
    schedule = schedules.get_schedule(name, num_ranks, num_microbatches, **options)
    return [" ".join(str(a) for a in row) for row in schedule.actions]
