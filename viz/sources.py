"""What pipeviz draws: a named schedule generated, a CSV schedule or a timeline read."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import schedules
from schedules import Schedule, ScheduleError, Timeline
from schedules.csvio import MAX_CSV_BYTES
from schedules.files import FileRefused, read_file
from viz.limits import LimitError, check_csv, check_named, check_schedule, check_timeline
from viz.usage import UsageError

__all__ = ["DEFAULT_MICROBATCHES", "DEFAULT_RANKS", "load"]

DEFAULT_RANKS, DEFAULT_MICROBATCHES = 4, 8
# Options of named schedules only: a CSV or a timeline gives its own.
_NAMED_ONLY = (("ranks", "--ranks"), ("stages_per_rank", "--stages-per-rank"),
               ("batches", "--batches"))


def load(source: str, args: argparse.Namespace, *, lenient: bool,
          used: set[str]) -> Schedule | Timeline:
    """A schedule (named, or from a CSV) or a timeline; `used` collects the options applied."""
    if source in schedules.available():
        schedule = _generate(source, args, lenient=lenient, used=used)
        return _lowered(schedule, args)
    path = Path(source)
    if path.is_dir():
        raise UsageError(f"{source} is a directory; give a schedule name "
                          f"({', '.join(schedules.available())}), a .csv schedule file or a "
                          f".json timeline file (written by a run or by --format json)")
    if not path.is_file():
        if path.suffix.lower() in (".csv", ".json") or os.sep in source:
            raise UsageError(f"no such file: {source}")
        raise UsageError(f"unknown schedule {source!r}; known: "
                          f"{', '.join(schedules.available())} (or give a .csv schedule or a "
                          f".json timeline)")
    try:  # through the file gate: a regular file, no planted link, bounded
        text = read_file(path, limit=MAX_CSV_BYTES).decode("utf-8")
    except (OSError, FileRefused, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {source}: {exc}") from None
    is_timeline = path.suffix.lower() == ".json" or text.lstrip().startswith("{")
    given = [flag for attr, flag in _NAMED_ONLY if getattr(args, attr) is not None]
    if is_timeline:
        given += [flag for attr, flag in (("microbatches", "--microbatches"),
                                          ("costs", "--costs"), ("lower", "--lower"),
                                          ("syncs", "--syncs"))
                  if getattr(args, attr) not in (None, False)]
    if given and not lenient:
        what = "a timeline carries its own times" if is_timeline else "a CSV gives its own"
        verb = "applies" if len(given) == 1 else "apply"
        raise UsageError(f"{', '.join(given)} {verb} to named schedules; {what} ({source})")
    try:
        if is_timeline:
            check_timeline(text)
            return Timeline.from_json(text)
        check_csv(text)
        schedule = schedules.loads_csv(text, num_microbatches=args.microbatches, name=path.name)
        check_schedule(schedule)
    except (ScheduleError, ValueError) as exc:  # LimitError is a ValueError
        raise UsageError(f"{source}: {exc}") from None
    return _lowered(schedule, args)


def _lowered(schedule: Schedule, args: argparse.Namespace) -> Schedule:
    """`--syncs`: the program; `--lower`: the lowered schedule; else as it is."""
    if args.syncs is not None:
        try:
            return schedules.program(schedule, args.syncs)
        except ScheduleError as exc:
            raise UsageError(f"--syncs {args.syncs}: {exc}") from None
    return schedules.lower(schedule) if args.lower else schedule


def _generate(name: str, args: argparse.Namespace, *, lenient: bool,
              used: set[str]) -> Schedule:
    flags = {"stages_per_rank": "stages_per_rank", "num_batches": "batches"}
    options = {key: value for key, value in (("stages_per_rank", args.stages_per_rank),
                                             ("num_batches", args.batches)) if value is not None}
    ranks = args.ranks or DEFAULT_RANKS
    microbatches = args.microbatches or DEFAULT_MICROBATCHES
    if lenient:
        # Comparing: each option goes to the schedules that take it (--stages-per-rank to
        # interleaved only).
        try:
            accepted = schedules.options(name)
        except ScheduleError as exc:
            raise UsageError(str(exc)) from None
        options = {key: value for key, value in options.items() if key in accepted}
    try:
        check_named(name, ranks, microbatches, options)
        schedule = schedules.get_schedule(name, ranks, microbatches, **options)
        check_schedule(schedule)
    except (ScheduleError, LimitError) as exc:
        raise UsageError(str(exc)) from None
    used.update(flags[key] for key in options)
    return schedule
