"""The program of a training step: a lowered schedule plus its synchronisations, as actions.

DeepSpeed's pipeline engine makes `ReduceTiedGrads`, `ReduceGrads` and `OptimizerStep`
instructions of its schedule; `program(schedule, syncs)` does the same here, so that one
validator, one simulator and one drawing cover everything a step does across ranks:

- Tied weights (`Syncs.ties`). Refresh: the owner's rank sends its values first of all
  (`SEND_T` opens its row: nothing it does before changes them), the copy's rank posts the
  receive first of all (`RECV_T`) and takes the values (`TIE_SET`) right before the copy
  stage's first forward, so the wait hides behind the pipeline's fill. Gradients: after the
  rank's last action (and after the dp averages: a copy's gradient is averaged over the
  replicas before it is added, as the owner's is, so the sums are those of a step without
  the program), the copy's rank sends them (`SEND_G`), the owner's rank posts (`RECV_G`) and
  adds them (`TIE_ADD`), copies in increasing stage order: the owner's own gradient first, then
  each copy's, the order autograd accumulates them on one device. A copy on the owner's rank
  needs no message: `TIE_SET` and `TIE_ADD` alone. Tie messages are the first (values) or the
  last (gradients) between their two ranks, sent and posted in link order on both sides, so
  each pair's receives stay in its sender's order whatever schedule they join.
- Data parallelism (`Syncs.dp`). `REDUCE_GRAD` (torch's name) launches the all-reduce of a
  stage's gradients right after its last gradient action (B, W or 2BW's U) and the sends that
  follow it (where torch's lowering puts it: the peer's data leaves first), so it overlaps the
  backwards still running; `AWAIT_GRAD` waits for all of the rank's reductions at its end.
- The loss scaler (`Syncs.scaler`): `OVERFLOW`, every rank's last action, a collective of the
  whole pipeline: no rank's optimizer steps on gradients another rank found non-finite.

Only a step with a backward reduces gradients; a forward-only program refreshes ties alone.
`lower(schedule)` stays the plain lowering; `program(schedule, Syncs())` is exactly it.
"""

from __future__ import annotations

from collections.abc import Callable

from schedules.ir import SYNC_OPS, Action, Op, Schedule
from schedules.lower import lower
from schedules.syncs import Syncs

__all__ = ["gradient_keys", "infer", "program", "sync_prerequisites", "training"]

Key = tuple[int, Op, int]
_GRADIENT_OPS = (Op.B, Op.W, Op.U)
_TIES = frozenset({Op.SEND_T, Op.RECV_T, Op.TIE_SET, Op.SEND_G, Op.RECV_G, Op.TIE_ADD})


def training(schedule: Schedule) -> bool:
    """Whether `schedule` runs backwards (a forward-only program reduces no gradients)."""
    return any(a.op is Op.B or a.op is Op.I for row in schedule.actions for a in row)


def program(schedule: Schedule, syncs: Syncs | None = None) -> Schedule:
    """`schedule` lowered, with the actions of `syncs` placed (see the module docstring).

    A schedule that is already a program is stripped of its syncs and placed again.
    """
    syncs = Syncs() if syncs is None else syncs
    plain = schedule
    if any(a.op in SYNC_OPS for row in schedule.actions for a in row):
        plain = schedule.replace(actions=tuple(tuple(a for a in row if a.op not in SYNC_OPS)
                                               for row in schedule.actions))
    lowered = lower(plain.replace(syncs=None)).replace(syncs=syncs)  # checks syncs' stages
    if syncs.empty:
        return lowered
    rank_of = lowered.rank_of
    grads = training(lowered)
    links = syncs.links if lowered.num_stages > 1 else ()
    rows = []
    for rank, row in enumerate(lowered.actions):
        first = min(lowered.stages_of(rank))
        head = [Action(o, Op.SEND_T, c) for o, c in links
                if rank_of(o) == rank != rank_of(c)]
        head += [Action(c, Op.RECV_T, o) for o, c in links
                 if rank_of(c) == rank != rank_of(o)]
        sets: dict[int, list[Action]] = {}
        for o, c in links:
            if rank_of(c) == rank:
                sets.setdefault(c, []).append(Action(c, Op.TIE_SET, o))
        after: dict[int, list[Action]] = {}
        if grads and syncs.dp:
            for stage, i in _last_gradients(row).items():
                while i + 1 < len(row) and row[i + 1].op in (Op.SEND_F, Op.SEND_B):
                    i += 1
                after.setdefault(i, []).append(Action(stage, Op.REDUCE_GRAD, 0))
        body = list(head)
        for i, a in enumerate(row):
            if a.op is Op.F and a.stage in sets:
                body += sets.pop(a.stage)
            body.append(a)
            body += after.get(i, ())
        if grads:
            if syncs.dp:
                body.append(Action(first, Op.AWAIT_GRAD, 0))
            body += [Action(c, Op.SEND_G, o) for o, c in links
                     if rank_of(c) == rank != rank_of(o)]
            body += [Action(o, Op.RECV_G, c) for o, c in links
                     if rank_of(o) == rank != rank_of(c)]
            body += [Action(o, Op.TIE_ADD, c) for o, c in links if rank_of(o) == rank]
            if syncs.scaler:
                body.append(Action(first, Op.OVERFLOW, 0))
        rows.append(tuple(body))
    return lowered.replace(actions=tuple(rows), syncs=syncs)


def _last_gradients(row: tuple[Action, ...]) -> dict[int, int]:
    """Per stage of a rank's row, the position of its last gradient action."""
    return {a.stage: i for i, a in enumerate(row) if a.op in _GRADIENT_OPS}


def infer(schedule: Schedule) -> Syncs:
    """The syncs a schedule's actions carry out (for a program read without its `syncs`)."""
    links: set[tuple[int, int]] = set()
    dp = scaler = False
    for row in schedule.actions:
        for a in row:
            op = a.op
            if op in (Op.SEND_T, Op.RECV_G, Op.TIE_ADD):  # on the owner stage
                links.add((a.stage, a.microbatch))
            elif op in (Op.RECV_T, Op.SEND_G, Op.TIE_SET):  # on the copy stage
                links.add((a.microbatch, a.stage))
            dp = dp or op in (Op.REDUCE_GRAD, Op.AWAIT_GRAD)
            scaler = scaler or op is Op.OVERFLOW
    return Syncs.of(((o, (c,)) for o, c in links if o != c), dp=dp, scaler=scaler)


def gradient_keys(schedule: Schedule, present: set[Key], stage: int) -> list[Key]:
    """The actions after which `stage`'s gradients of the step are final: each micro-batch's
    W (else B), and each batch's update where the schedule has them."""
    out: list[Key] = [(stage, Op.W, m) if (stage, Op.W, m) in present else (stage, Op.B, m)
                      for m in range(schedule.total_microbatches)]
    return out + [(stage, Op.U, b) for b in range(schedule.num_batches)
                  if (stage, Op.U, b) in present]


def sync_prerequisites(schedule: Schedule, syncs: Syncs,
                       present: set[Key]) -> Callable[[Action], tuple[Key, ...]]:
    """The prerequisites of a program's sync actions, and those a copy stage's forwards gain
    (its `TIE_SET`s), as `schedules.graph.prerequisites` states the rest.

    `OVERFLOW` is a collective: each rank's waits for the action before every other rank's.
    """
    rank_of = schedule.rank_of
    first = [min(schedule.stages_of(r)) for r in range(schedule.num_ranks)]
    owners: dict[int, list[int]] = {}
    previous: dict[tuple[int, int], int] = {}  # (owner, copy) -> the owner's copy before it
    for o, copies in syncs.ties:
        for k, c in enumerate(copies):
            owners.setdefault(c, []).append(o)
            if k:
                previous[(o, c)] = copies[k - 1]
    before: dict[int, Key] = {}  # rank -> the action before its OVERFLOW
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if a.op is Op.OVERFLOW and i:
                p = row[i - 1]
                before[rank] = (p.stage, p.op, p.microbatch)

    def grads(stage: int) -> list[Key]:
        return gradient_keys(schedule, present, stage)

    def waited(stage: int) -> list[Key]:
        return [(first[rank_of(stage)], Op.AWAIT_GRAD, 0)] if syncs.dp else []

    def deps(a: Action) -> tuple[Key, ...]:
        s, op, peer = a.stage, a.op, a.microbatch
        if op is Op.F:
            return tuple((s, Op.TIE_SET, o) for o in owners.get(s, ()))
        cross = op in _TIES and rank_of(s) != rank_of(peer)
        if op is Op.TIE_SET:
            return ((s, Op.RECV_T, peer), (peer, Op.SEND_T, s)) if cross else ()
        if op is Op.SEND_G:
            return (*grads(s), *waited(s))
        if op is Op.TIE_ADD:
            out = [*grads(s), *waited(s)]
            out += ([(s, Op.RECV_G, peer), (peer, Op.SEND_G, s)] if cross else grads(peer))
            if (s, peer) in previous:
                out.append((s, Op.TIE_ADD, previous[(s, peer)]))
            return tuple(out)
        if op is Op.REDUCE_GRAD:
            return tuple(grads(s))
        if op is Op.AWAIT_GRAD:
            return tuple((t, Op.REDUCE_GRAD, 0) for t in schedule.stages_of(rank_of(s)))
        if op is Op.OVERFLOW:
            return tuple(key for r, key in sorted(before.items()) if r != rank_of(s))
        return ()  # SEND_T (the owner's values are there from the start), RECV_T, RECV_G

    return deps

