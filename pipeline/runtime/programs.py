"""A Pipe's programs: its schedule lowered per step shape, with the step's syncs placed, cached."""

from __future__ import annotations

from collections.abc import Sequence

import schedules
from pipeline.splitting import config
from schedules import Action, Op, Schedule, Syncs

__all__ = ["Programs"]


class Programs:
    """Builds, validates and keeps the schedule and the program of each step shape: a shape is
    built once and every step of it reuses it."""

    def __init__(self, schedule: str | Schedule, balance: Sequence[int], num_ranks: int,
                 ties: Sequence[tuple[int, list[int]]], dp: bool, processes: bool) -> None:
        self.arg = schedule
        self.balance = list(balance)
        self.num_ranks = num_ranks
        self.ties = list(ties)  # (owner stage, copy stages) per tied weight
        self.dp = dp
        self.processes = processes
        self._schedules: dict[tuple[int, int], Schedule] = {}  # lowered, per (chunks, batches)
        self._programs: dict[tuple[int, int, bool], Schedule] = {}
        self._versioned: dict[int, bool] = {}  # id of a program held here -> versioned

    def schedule(self, chunks: int, num_batches: int) -> Schedule:
        """The lowered, validated schedule for `chunks` micro-batches x `num_batches` batches."""
        key = (chunks, num_batches)
        if key not in self._schedules:
            self._schedules[key] = config.make_schedule(self.arg, self.balance, self.num_ranks,
                                                        chunks, num_batches)
        return self._schedules[key]

    def adopt(self, schedule: Schedule) -> None:
        """Run `schedule` (one batch of its micro-batches) from the next step on, in place of
        what was built for that shape: `schedule="auto"` switching to the order synthesised
        for measured costs (pipeline/auto_schedule.py). Programs built from the old one go."""
        chunks = schedule.num_microbatches
        built = config.make_schedule(schedule, self.balance, self.num_ranks, chunks, 1)
        self._schedules.pop((chunks, 0), None)  # the forward-only order follows it
        self._schedules[(chunks, 1)] = built
        for key in [k for k in self._programs if k[0] == chunks and k[1] in (0, 1)]:
            self._versioned.pop(id(self._programs.pop(key)), None)

    def program(self, chunks: int, *, batches: int = 1, scaler: bool = False,
                train: bool = True) -> Schedule:
        """See `Pipe.program`."""
        agree = scaler and train and self.processes  # one process: one scaler sees all
        key = (chunks, batches if train else 0, agree)
        if key not in self._programs:
            syncs = Syncs.of(self.ties, dp=train and self.dp, scaler=agree)
            if train:
                built = schedules.validate(schedules.program(self.schedule(chunks, batches),
                                                             syncs))
            else:  # forward-only schedules leave the validator's rules for training
                built = schedules.program(self.forward_only(chunks), syncs)
            self._programs[key] = built
            self._versioned[id(built)] = any(a.version is not None for row in built.actions
                                             for a in row)
        return self._programs[key]

    def versioned(self, program: Schedule) -> bool:
        """Whether `program` (built here) runs on weight versions (2BW): read when it was
        built, not at every step (a walk over every rank's actions)."""
        return self._versioned[id(program)]

    def forward_only(self, chunks: int) -> Schedule:
        """The schedule's forwards in its order, lowered; inference uses the current weights."""
        key = (chunks, 0)  # no batch count is 0: a key of its own in the cache
        if key not in self._schedules:
            compute = self.schedule(chunks, 1).compute_only()
            self._schedules[key] = schedules.lower(compute.replace(actions=tuple(
                tuple(Action(a.stage, Op.F, a.microbatch) for a in row if a.op is Op.F)
                for row in compute.actions)))
        return self._schedules[key]

    @property
    def multi_batch(self) -> bool:
        """Whether several batches run as one schedule (weight-versioned, 2BW)."""
        if isinstance(self.arg, Schedule):
            return self.arg.num_batches > 1
        return schedules.info(self.arg).multi_batch
