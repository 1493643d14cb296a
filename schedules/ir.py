"""The schedule IR: ops, actions and per-rank action lists, as frozen data."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from schedules.syncs import Syncs

__all__ = ["COMM_OPS", "COMPUTE_OPS", "RECV_OPS", "SEND_OPS", "SYNC_LABELS", "SYNC_OPS",
           "Action", "Op", "Schedule", "ScheduleError"]


class ScheduleError(ValueError):
    """A schedule breaks a rule: incomplete, out of order, misplaced or deadlocking.

    `str(error)` is the whole report (the validator appends the rank x step grid); `reason` is
    the rule and value alone, and `marks` maps each failing rank to its step, for tools.
    """

    def __init__(self, message: str, *, reason: str | None = None,
                 marks: dict[int, int] | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason
        self.marks = dict(marks or {})


class Op(str, Enum):
    """What an action does; the letters follow torch.distributed.pipelining's grammar."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients together)
    I = "I"  # backward, input gradient only (zero-bubble)
    W = "W"  # backward, weight gradient only (zero-bubble)
    U = "U"  # weight update of a stage at the end of a batch (PipeDream-2BW)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    # The step's synchronisations (see schedules/program.py). None starts with a letter of
    # torch's grammar (F, I, B, W), whose reader would take "0WAIT0" for "0W": only
    # REDUCE_GRAD is torch's own, and means what torch means by it.
    SEND_T = "SEND_T"  # tied weights, owner stage -> a copy stage (index: the copy stage)
    RECV_T = "RECV_T"  # a copy stage posts that receive (index: the owner stage)
    TIE_SET = "TIE_SET"  # a copy stage takes its owner's values (index: the owner stage)
    SEND_G = "SEND_G"  # a copy's gradients -> the owner stage (index: the owner stage)
    RECV_G = "RECV_G"  # the owner stage posts that receive (index: the copy stage)
    TIE_ADD = "TIE_ADD"  # the owner adds a copy's gradients to its own (index: the copy stage)
    REDUCE_GRAD = "REDUCE_GRAD"  # launch the dp all-reduce of a stage's gradients (index 0)
    AWAIT_GRAD = "AWAIT_GRAD"  # wait for every reduction of the rank (index 0)
    OVERFLOW = "OVERFLOW"  # the ranks agree whether any gradient overflowed (index 0)

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W, Op.U})
SEND_OPS = frozenset({Op.SEND_F, Op.SEND_B, Op.SEND_T, Op.SEND_G})
RECV_OPS = frozenset({Op.RECV_F, Op.RECV_B, Op.RECV_T, Op.RECV_G})
COMM_OPS = SEND_OPS | RECV_OPS
# Actions of a program's synchronisations: placed by schedules.program, never by a generator.
SYNC_OPS = frozenset({Op.SEND_T, Op.RECV_T, Op.TIE_SET, Op.SEND_G, Op.RECV_G, Op.TIE_ADD,
                      Op.REDUCE_GRAD, Op.AWAIT_GRAD, Op.OVERFLOW})

# Two letters for each sync in drawings (pipeviz): Send/Recv/Take/Add of Tied weights or
# their Gradients, ReDuce, AWait, OVerflow.
SYNC_LABELS = {"SEND_T": "St", "RECV_T": "Rt", "TIE_SET": "Ts", "SEND_G": "Sg", "RECV_G": "Rg",
               "TIE_ADD": "Ta", "REDUCE_GRAD": "Rd", "AWAIT_GRAD": "Aw", "OVERFLOW": "Ov"}
assert set(SYNC_LABELS) == {op.value for op in SYNC_OPS}

# Longest names first so that "SEND_F" is not read as "S" + ... and "B" never shadows "RECV_B".
_ACTION_RE = re.compile(r"^(\d+)(" + "|".join(sorted((op.value for op in Op), key=len,
                                                      reverse=True)) + r")(\d+)(?:v(\d+))?$")
# Longer numbers are refused before int() sees them: Python refuses over 4300 digits with an
# error that names no action, and no schedule needs an index past 10**18.
_MAX_DIGITS = 18


@dataclass(frozen=True, slots=True, order=True, init=False)
class Action:
    """One step of one rank: `op` on `stage` for `microbatch`.

    For `Op.U` the `microbatch` field holds the batch index. `version` is the weight version a
    PipeDream-2BW action computes with (None elsewhere). `str(a)` is torch's compact form `"2F0"`
    (with `"v1"` appended when a version is set); `Action.parse` reads it back.
    """

    stage: int
    op: Op
    microbatch: int
    version: int | None = None

    # The checks a `__post_init__` would hold, in a hand-written `__init__` that fills the slots
    # directly: a frozen dataclass's own `__init__` goes through `object.__setattr__` by name,
    # about twice the cost, and schedules hold hundreds of thousands of actions.
    def __init__(self, stage: int, op: Op, microbatch: int, version: int | None = None) -> None:
        if not isinstance(op, Op):
            op = Op(op)
        if stage < 0 or microbatch < 0:
            raise ScheduleError(
                f"action stage and micro-batch must be >= 0 (got stage={stage}, "
                f"microbatch={microbatch})"
            )
        if version is not None and version < 0:
            raise ScheduleError(f"weight version must be >= 0 (got {version})")
        _SET_STAGE(self, stage)
        _SET_OP(self, op)
        _SET_MICROBATCH(self, microbatch)
        _SET_VERSION(self, version)

    def __str__(self) -> str:
        text = f"{self.stage}{self.op.value}{self.microbatch}"
        return text if self.version is None else f"{text}v{self.version}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the compact form back: `"2F0"`, `"1SEND_B3"`, `"0F5v1"`, `"1U0"`."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><op><micro-batch>[v<version>] "
                f"with op one of {', '.join(op.value for op in Op)}, e.g. '2F0' or '1SEND_B3'"
            )
        stage, op, microbatch, version = match.groups()
        longest = max((stage, microbatch, version or ""), key=len)
        if len(longest) > _MAX_DIGITS:
            shown = text if len(text) <= 40 else f"{text.strip()[:20]}..."
            raise ScheduleError(
                f"numbers in an action have at most {_MAX_DIGITS} digits (got {len(longest)} in "
                f"{shown!r}): stage, micro-batch and version count from 0, e.g. '2F0'"
            )
        return cls(int(stage), Op(op), int(microbatch), None if version is None else int(version))

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS


_SET_STAGE, _SET_OP, _SET_MICROBATCH, _SET_VERSION = (
    Action.__dict__[name].__set__ for name in ("stage", "op", "microbatch", "version"))

_PLACEMENTS = ("loop", "v")


def _stage_rank(stage: int, num_ranks: int, placement: str) -> int:
    if placement == "loop":
        return stage % num_ranks
    # "v": the stages zig-zag, 0..p-1 down the ranks and p..2p-1 back up, and so on.
    chunk, offset = divmod(stage, num_ranks)
    return offset if chunk % 2 == 0 else num_ranks - 1 - offset


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-rank action lists for one pipeline step (or `num_batches` steps for PipeDream-2BW).

    `num_microbatches` counts micro-batches per batch; with `num_batches > 1` micro-batch indices
    run over all batches (batch b holds `b * num_microbatches ... (b + 1) * num_microbatches - 1`).
    `syncs` is set on a program (`schedules.program`): the synchronisations its actions must
    carry out, which the validator checks them against.
    """

    num_ranks: int
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"
    num_batches: int = 1
    name: str = "custom"
    syncs: Syncs | None = None
    _rank_of: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for what, value in (
            ("num_ranks", self.num_ranks),
            ("num_stages", self.num_stages),
            ("num_microbatches", self.num_microbatches),
            ("num_batches", self.num_batches),
        ):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{what} must be a positive int (got {value!r})")
        if self.placement not in _PLACEMENTS:
            raise ScheduleError(
                f"placement must be one of {_PLACEMENTS} (got {self.placement!r})"
            )
        if self.num_stages % self.num_ranks != 0:
            raise ScheduleError(
                f"num_stages must be a multiple of num_ranks so every rank holds the same number "
                f"of stages (got {self.num_stages} stages on {self.num_ranks} ranks)"
            )
        if len(self.actions) != self.num_ranks:
            raise ScheduleError(
                f"actions must hold one list per rank (got {len(self.actions)} lists for "
                f"{self.num_ranks} ranks)"
            )
        if self.syncs is not None:
            stages = [s for link in self.syncs.links for s in link]
            if stages and max(stages) >= self.num_stages:
                raise ScheduleError(f"syncs {self.syncs} name stage {max(stages)}, but the "
                                    f"schedule has stages 0..{self.num_stages - 1}")
        actions = tuple(tuple(row) for row in self.actions)
        object.__setattr__(self, "actions", actions)
        ranks = tuple(
            _stage_rank(s, self.num_ranks, self.placement) for s in range(self.num_stages)
        )
        object.__setattr__(self, "_rank_of", ranks)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    @property
    def total_microbatches(self) -> int:
        """Micro-batches over all batches: the range of `Action.microbatch` for F and B."""
        return self.num_microbatches * self.num_batches

    def rank_of(self, stage: int) -> int:
        """The rank that holds `stage` under this schedule's placement."""
        return self._rank_of[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages held by `rank`, in increasing order."""
        return tuple(s for s in range(self.num_stages) if self._rank_of[s] == rank)

    def batch_of(self, microbatch: int) -> int:
        return microbatch // self.num_microbatches

    @property
    def has_comms(self) -> bool:
        return not all({a.op for a in row} <= COMPUTE_OPS for row in self.actions)

    def compute_only(self) -> Schedule:
        """This schedule without its SEND/RECV actions (and a program without its syncs)."""
        rows = tuple(tuple(a for a in row if a.is_compute) for row in self.actions)
        return self.replace(actions=rows, syncs=None)

    def replace(self, **changes: object) -> Schedule:
        fields = {
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "actions": self.actions,
            "placement": self.placement,
            "num_batches": self.num_batches,
            "name": self.name,
            "syncs": self.syncs,
        }
        fields.update(changes)
        return Schedule(**fields)  # type: ignore[arg-type]

    def __str__(self) -> str:
        from schedules.text import format_grid  # local: text imports this module

        return format_grid(self)
