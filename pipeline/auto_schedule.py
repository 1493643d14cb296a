"""`schedule="auto"` in a Pipe: the first step timed under the unit-cost order, the rest run the
order synthesised for what it measured.

By name, `auto` is synthesised at equal unit costs (zb-h1 under 1F1B's memory), which is what
every rank can build before anything has run. The first training step runs that order (exact,
as every schedule is) while the runtime times each action's compute, from when it has its
inputs to when it ends (the timeline `Pipe.last_timeline()` shows), less the time the thread
that ran it waited on a CPU's run queue in that span (pipeline/schedstat.py: the kernel's
per-thread count, read before and after each compute action of that step only; where the
kernel keeps none, the wall time, with one note). Waits of other threads are not read: the
intra-op workers (OpenMP) of a CPU op that fans out wait on run queues too, and their waits
stay in the time as far as the acting thread waits for them; on a GPU the times are the CUDA
events', taken as they are. Per stage, the medians over micro-batches of its F, I and W, and
the median host time of a SEND as the transfer, are the costs `schedules.auto.search`
synthesises for; every later step runs that schedule.

Every rank must run the same order. In one process one timeline holds every rank's actions.
Over processes each rank times only its own stage: the ranks exchange their measurements
(the same list of texts on every rank), so every rank synthesises from identical numbers, and
the search is deterministic. A rank that fails while measuring tells the others (the
transport's abort), which raise instead of waiting for its numbers.

Replicas (dp, torchft) and tensor parallelism do not measure: replicas would measure apart and
tp peers of a stage must run one order; they keep the unit-cost order unless every rank is
given the same costs with `pipe.auto.use(costs)`.
"""

from __future__ import annotations

import json
import statistics
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.comm.failures import PeerFailure, PeerTimeout, PipelineAborted
from pipeline.errors import PipeConfigError, PipelineError, PipeTypeError
from pipeline.schedstat import ThreadWait
from schedules import Action, Costs, Event, Op, Schedule
from schedules.auto import Synthesis, search

if TYPE_CHECKING:
    from pipeline.pipe import Pipe

__all__ = ["AutoSchedule", "check_memory", "stage_costs"]

_DIGITS = 6  # seconds rounded to microseconds: shown plainly, and never below this
_FLOOR = 1e-6
_SENDS = (Op.SEND_F, Op.SEND_B)


def check_memory(auto_memory: object, schedule: object, num_ranks: int | None = None
                 ) -> int | list[int] | None:
    """`Pipe(auto_memory=...)`: an int >= 1 or one per rank, only with `schedule="auto"`."""
    if auto_memory is None:
        return None
    if schedule != "auto":
        raise PipeConfigError(
            f"auto_memory={auto_memory!r} limits the schedule that schedule='auto' synthesises, "
            f"but schedule is {getattr(schedule, 'name', schedule)!r}: pass schedule='auto' or "
            f"drop auto_memory")
    values = [auto_memory] if isinstance(auto_memory, int) else auto_memory
    if (not isinstance(values, Sequence) or isinstance(values, str) or not values
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
            or (num_ranks is not None and not isinstance(auto_memory, int)
                and len(values) != num_ranks)):
        error = PipeConfigError if isinstance(auto_memory, int | Sequence) else PipeTypeError
        raise error(
            f"auto_memory must be an int >= 1 or a list of one such int per rank (got "
            f"{auto_memory!r}): the most micro-batches a rank holds from a forward until its "
            f"weight gradient, e.g. auto_memory=2; default: the number of ranks (1F1B's peak)")
    return auto_memory if isinstance(auto_memory, int) else list(values)


def stage_costs(events: Iterable[Event], stages: Iterable[int],
                waited: Mapping[tuple[int, Action], float] | None = None
                ) -> dict[int, tuple[float, float, float]]:
    """Per stage of `stages`: the medians over micro-batches of its F, I and W seconds in
    `events` (a measured timeline's); a whole backward B counts half as I and half as W.
    `waited`: per (rank, action), the seconds its thread waited on a CPU's run queue in its
    span, taken off its wall time (never below the floor)."""
    waited = waited or {}
    seen: dict[tuple[int, Op], list[float]] = {}
    for e in events:
        if e.action.op in (Op.F, Op.B, Op.I, Op.W):
            busy = e.end - e.start - waited.get((e.rank, e.action), 0.0)
            seen.setdefault((e.action.stage, e.action.op), []).append(max(busy, _FLOOR))
    out = {}
    for s in stages:
        if (s, Op.F) not in seen:
            raise PipelineError(f"schedule='auto': the measured step ran no forward of stage "
                                f"{s}, so its costs are unknown")
        f = statistics.median(seen[(s, Op.F)])
        if (s, Op.I) in seen and (s, Op.W) in seen:
            i, w = statistics.median(seen[(s, Op.I)]), statistics.median(seen[(s, Op.W)])
        else:
            i = w = statistics.median(seen.get((s, Op.B), [0.0])) / 2
        out[s] = (_seconds(f), _seconds(i), _seconds(w))
    return out


class AutoSchedule:
    """What `Pipe(..., schedule="auto")` runs, as `pipe.auto`.

    `schedule`: the order steps run now (compute actions, not lowered): the unit-cost order
    until the first training step has been measured, then the synthesised one. `costs`: the
    per-stage `schedules.Costs` (seconds) it was synthesised for, None before. `synthesis`: the
    search's report (`chosen` candidate, simulated `makespan`, `best_fixed`). `memory_limit`:
    the micro-batches each rank may hold, per rank. `measures`: whether the first step is timed.
    `thread_wait`: what reads a thread's run-queue wait in the timed step (a test's fake).
    """

    def __init__(self, pipe: Pipe, chunks: int, memory: int | Sequence[int] | None) -> None:
        p = pipe.num_ranks
        check_memory(memory, "auto", p)
        self.memory_limit: list[int] = (
            [p] * p if memory is None else [memory] * p if isinstance(memory, int)
            else list(memory))
        self.chunks = chunks
        mesh = pipe.mesh
        self.measures = pipe._ft is None and (mesh is None or (mesh.dp_size, mesh.tp_size)
                                              == (1, 1))
        self.costs: Costs | None = None
        self.thread_wait: Callable[[], int | None] = ThreadWait()
        self.synthesis: Synthesis | None = None
        # Weakly: the Pipe holds this, and must still be freed (its threads stopped) as soon
        # as its last reference goes, not at the next garbage collection.
        self._pipe = weakref.ref(pipe)
        # The warm-up order: unit costs within this memory (zb-h1 at the default).
        self.schedule = self._adopt(search(p, chunks, Costs(), self.memory_limit))

    def use(self, costs: Costs) -> Schedule:
        """Synthesise for `costs` (one value per stage, or one for all) and run that schedule
        from the next step on; returns it. Over processes every rank must pass the same costs.
        Nothing is measured after this."""
        if not isinstance(costs, Costs):
            raise PipeTypeError(f"pipe.auto.use takes a schedules.Costs (got "
                                f"{type(costs).__name__}): e.g. Costs(forward=[1, 3], "
                                f"backward_input=[1, 3], backward_weight=[1, 6])")
        found = search(self._owner().num_ranks, self.chunks, costs, self.memory_limit)
        self.costs, self.synthesis = costs, found
        self.schedule = self._adopt(found)
        return self.schedule

    def profiling(self) -> Callable[[], int | None] | None:
        """For the next step's inputs: the run-queue wait reader while that step is the one
        timed, else None (no step after it pays for the reads)."""
        return self.thread_wait if self.measures and self.costs is None else None

    def after_step(self) -> None:
        """After a training step: the first one's measured costs agreed and synthesised for."""
        if self.costs is not None or not self.measures:
            return
        pipe = self._owner()
        exchange = pipe._executor.exchange
        try:
            own = self.measure()
        except Exception as exc:
            rank = pipe.world[0] if pipe.world is not None else None
            message = (f"rank {rank if rank is not None else '(threads)'} failed measuring "
                       f"schedule='auto''s costs: {type(exc).__name__}: {exc}")
            if exchange is not None and rank is not None:  # the others wait for these
                pipe._executor.transport.abort(rank, message)  # numbers: say why not
            raise PipelineError(message) from exc
        payloads = [own] if exchange is None else _exchanged(pipe, exchange, own)
        self.use(_costs(payloads, len(pipe.balance)))

    def measure(self) -> str:
        """This process's measurement of the last step: its stages' F, I and W and its SENDs'
        host time, as the text the ranks exchange."""
        pipe = self._owner()
        timeline = pipe.last_timeline()
        ranks = {rt.rank for rt in pipe._executor.runtimes}
        stages = [s for s in range(len(pipe.balance)) if pipe._probe.rank_of(s) in ranks]
        sends = [e.end - e.start for rt in pipe._executor.runtimes for e in rt.comm
                 if e.action.op in _SENDS]
        # Each compute action's run-queue wait, as its runtime read it (none on a GPU).
        waited = {(rt.rank, e.action): q for rt in pipe._executor.runtimes
                  for e, q in zip(rt.events, rt.queued, strict=False)}
        return json.dumps({"stages": {str(s): c for s, c in
                                      stage_costs(timeline.events, stages, waited).items()},
                           "comm": round(statistics.median(sends), _DIGITS) if sends else 0.0})

    def _adopt(self, found: Synthesis) -> Schedule:
        self._owner()._programs.adopt(found.schedule)
        return found.schedule

    def _owner(self) -> Pipe:
        pipe = self._pipe()
        if pipe is None:
            raise PipelineError("schedule='auto': its Pipe is gone (closed and freed)")
        return pipe


def _exchanged(pipe: Pipe, exchange: Callable[[str], list[str]], own: str) -> list[str]:
    """Every rank's measurement, the same list on every rank (failures named, not waited)."""
    assert pipe.world is not None
    try:
        return exchange(own)
    except PipelineAborted as exc:
        raise PipelineError(str(exc)) from None
    except (PeerFailure, PeerTimeout) as exc:
        pipe._executor.transport.abort(pipe.world[0], str(exc))
        raise PipelineError(f"while the ranks exchanged schedule='auto''s measured costs: "
                            f"{exc}") from None


def _costs(payloads: Sequence[str], num_stages: int) -> Costs:
    """The per-stage costs the ranks' measurements add up to (transfer: the slowest rank's)."""
    stages: dict[int, Any] = {}
    comm = 0.0
    for text in payloads:
        given = json.loads(text)
        stages.update({int(s): c for s, c in given["stages"].items()})
        comm = max(comm, float(given["comm"]))
    missing = sorted(set(range(num_stages)) - set(stages))
    if missing:
        raise PipelineError(f"schedule='auto': no rank measured stage(s) {missing}")
    f, i, w = ([float(stages[s][k]) for s in range(num_stages)] for k in range(3))
    backward = [round(a + b, _DIGITS) for a, b in zip(i, w, strict=True)]  # what B costs: I + W
    return Costs(forward=f, backward_input=i, backward_weight=w, backward=backward, comm=comm)


def _seconds(value: float) -> float:
    return max(round(value, _DIGITS), _FLOOR)

