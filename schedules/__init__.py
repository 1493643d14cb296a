"""Pipeline schedules as plain data: generate, validate, simulate and exchange them (no torch)."""

from schedules.csvio import dump_csv, dumps_csv, load_csv, loads_csv
from schedules.ir import COMM_OPS, SYNC_LABELS, SYNC_OPS, Action, Op, Schedule, ScheduleError
from schedules.lower import lower
from schedules.program import program
from schedules.registry import GeneratorInfo, available, get_schedule, info, options, register
from schedules.simulate import Costs, Event, Timeline, peak_activations, simulate
from schedules.syncs import Syncs
from schedules.text import format_grid, from_text, to_text
from schedules.validate import validate

__all__ = [
    "COMM_OPS",
    "SYNC_LABELS",
    "SYNC_OPS",
    "Action",
    "Costs",
    "Event",
    "GeneratorInfo",
    "Op",
    "Schedule",
    "ScheduleError",
    "Syncs",
    "Timeline",
    "available",
    "dump_csv",
    "dumps_csv",
    "format_grid",
    "from_text",
    "get_schedule",
    "info",
    "load_csv",
    "loads_csv",
    "lower",
    "options",
    "peak_activations",
    "program",
    "register",
    "simulate",
    "to_text",
    "validate",
]
