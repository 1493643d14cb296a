"""pipeviz's limits: inputs beyond them are refused at once, before anything is built or drawn."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from schedules import Costs, Schedule

__all__ = ["MAX_ACTIONS", "MAX_INDEX", "MAX_RANKS", "LimitError", "check_costs", "check_csv",
           "check_named", "check_schedule", "check_timeline"]

MAX_RANKS = 256  # ranks (rows of a CSV, num_ranks of a timeline); also stages per rank
MAX_ACTIONS = 10_000  # compute actions: a drawing beyond this is unreadable and slow to make
MAX_INDEX = 9_999  # stage, micro-batch and version numbers in a CSV or a timeline
_MAX_DIGITS = 18  # a number with more digits is refused before Python converts it

_NUMBER = re.compile(r"\d+")


class LimitError(ValueError):
    """An input beyond pipeviz's documented limits."""


def _limits() -> str:
    return (f"pipeviz draws at most {MAX_RANKS} ranks and {MAX_ACTIONS} compute actions, with "
            f"stage, micro-batch and version numbers at most {MAX_INDEX}")


def check_costs(costs: Costs) -> Costs:
    """Every cost finite (NaN or infinity would make every time NaN)."""
    for name in ("forward", "backward", "backward_input", "backward_weight", "update", "comm",
                 "microbatch"):
        value = getattr(costs, name)
        for v in value if isinstance(value, tuple) else (value,):
            if not math.isfinite(v):
                raise LimitError(f"Costs.{name} must be a finite number >= 0 (got {v})")
    return costs


def _ranks(count: int, what: str) -> None:
    if count > MAX_RANKS:
        raise LimitError(f"at most {MAX_RANKS} ranks (got {what}); {_limits()}")


def check_named(name: str, ranks: int, microbatches: int, options: dict[str, int]) -> None:
    """A named schedule's size, judged before it is generated."""
    _ranks(ranks, str(ranks))
    per_rank = options.get("stages_per_rank", 1)
    if per_rank > MAX_RANKS:
        raise LimitError(f"at most {MAX_RANKS} stages per rank (got {per_rank})")
    # Every (stage, micro-batch) runs at least a forward and a backward.
    least = 2 * ranks * per_rank * microbatches * options.get("num_batches", 1)
    if least > MAX_ACTIONS:
        raise LimitError(f"{name} on {ranks} ranks x {microbatches} micro-batches has at least "
                         f"{least} compute actions; pipeviz draws at most {MAX_ACTIONS}: use "
                         f"fewer ranks or micro-batches")


def check_schedule(schedule: Schedule) -> None:
    """A built schedule's size (a named one may exceed the estimate; a CSV is checked here)."""
    count = sum(a.is_compute for row in schedule.actions for a in row)
    if count > MAX_ACTIONS:
        raise LimitError(f"{schedule.name} has {count} compute actions; {_limits()}")


def _index(text: str) -> None:
    for digits in _NUMBER.findall(text):
        if len(digits) > _MAX_DIGITS:
            raise LimitError(f"stage, micro-batch and version numbers are at most {MAX_INDEX} "
                             f"(got a {len(digits)}-digit number)")
        if int(digits) > MAX_INDEX:
            raise LimitError(f"stage, micro-batch and version numbers are at most {MAX_INDEX} "
                             f"(got {digits})")


def check_csv(text: str) -> None:
    """A CSV schedule's rows and numbers, before it is parsed."""
    rows = text.rstrip("\n").count("\n") + 1
    _ranks(rows, f"{rows} rows")
    _index(text)  # a CSV holds only actions: every number is a stage, micro-batch or version
    cells = text.count(",") + rows
    if cells > MAX_ACTIONS * 4:  # idle cells included; the exact count is checked once built
        raise LimitError(f"the CSV has {cells} cells; {_limits()}")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise LimitError(f"numbers are at most {_MAX_DIGITS} digits (got a "
                         f"{len(text.lstrip('-'))}-digit number)")
    return int(text)


def check_timeline(text: str) -> None:
    """A timeline JSON's rank count, event count and action numbers, before it is loaded
    (its times are checked by `Timeline.from_json`)."""
    try:
        data: Any = json.loads(text, parse_int=_int)
    except LimitError:
        raise
    except ValueError:
        return  # malformed: Timeline.from_json says how
    if not isinstance(data, dict):
        return
    num_ranks = data.get("num_ranks")
    if isinstance(num_ranks, int | float) and not isinstance(num_ranks, bool) and not (
            num_ranks <= MAX_RANKS):  # NaN too
        shown = f"{num_ranks:g}" if isinstance(num_ranks, float) else str(num_ranks)
        raise LimitError(f"at most {MAX_RANKS} ranks (got num_ranks {shown}); {_limits()}")
    events = data.get("events")
    if isinstance(events, list):
        if len(events) > MAX_ACTIONS:
            raise LimitError(f"the timeline has {len(events)} events; {_limits()}")
        for event in events:
            if isinstance(event, list) and len(event) > 1 and isinstance(event[1], str):
                _index(event[1])
