"""The validator: a schedule is complete, well placed, ordered, version-safe and deadlock-free."""

from __future__ import annotations

from collections import Counter
from itertools import compress, repeat
from operator import eq

from schedules.graph import Key
from schedules.ir import COMM_OPS, COMPUTE_OPS, SEND_OPS, SYNC_OPS, Op, Schedule, ScheduleError
from schedules.lower import Message, consumed, message, source_stage
from schedules.planned import Plan, execute_by_kind, kind, plan, stage_op
from schedules.text import format_grid
from schedules.validate_syncs import check_syncs

__all__ = ["validate"]


def _fail(schedule: Schedule, message: str, marks: dict[int, int] | None = None) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, marks)}", reason=message,
                         marks=marks)


def _where(schedule: Schedule, key: Key) -> dict[int, int]:
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if (a.stage, a.op, a.microbatch) == key:
                return {rank: i}
    return {}


_U = Op.U
_SENDS = SEND_OPS
_CONSUMERS = COMPUTE_OPS | {Op.TIE_SET, Op.TIE_ADD}  # actions that take a message's data
# The range of an action's index: a stage for a tie action; the batch for U and the
# step's reductions; else the micro-batch.
_BY_STAGE = frozenset({Op.SEND_T, Op.RECV_T, Op.TIE_SET, Op.SEND_G, Op.RECV_G, Op.TIE_ADD})
_BY_BATCH = frozenset({Op.U, Op.REDUCE_GRAD, Op.AWAIT_GRAD, Op.OVERFLOW})

# A check below goes step by step, to report the first step that breaks its rule. Before it
# runs, a fast test passes the schedules it would pass (most of them, all those generated): one
# that fails the test may be fine, so the check itself runs and has the last word.


def _actions_ok(schedule: Schedule, found: Plan | None) -> bool:
    """`_check_actions` passes (False: it may not). With a plan, every action is on the rank
    that holds its stage and keys are unique: what is left is the range of micro-batches."""
    if found is None:  # a stage out of range or misplaced, a key repeated, or a deadlock
        return False
    total, num_batches = schedule.total_microbatches, schedule.num_batches
    for row in schedule.actions:
        microbatches = [a.microbatch for a in row if a.op is not _U]
        if microbatches and max(microbatches) >= total:
            return False
        if len(microbatches) < len(row) and max(
                a.microbatch for a in row if a.op is _U) >= num_batches:
            return False
    return True


def _complete_ok(schedule: Schedule, found: Plan | None) -> bool:
    """`_check_complete` passes (False: it may not), for a schedule that passed
    `_check_actions`: keys unique and in range, so counting them is nearly enough."""
    if found is None:
        return False
    count = Counter(found.kinds)
    total, num_batches = schedule.total_microbatches, schedule.num_batches
    stages = range(schedule.num_stages)
    batched = num_batches > 1 or any(count[kind(s, _U)] for s in stages)
    mixed = []  # stages running B for some micro-batches and I, W for the others
    for s in stages:
        f, b, i, w = (count[kind(s, op)] for op in (Op.F, Op.B, Op.I, Op.W))
        if f != total or b + i != total or w != i:
            return False
        if b and i:
            mixed.append(s)
        if batched and count[kind(s, _U)] != num_batches:
            return False
    if mixed:  # no micro-batch has both B and I (so each has one), and W goes with I
        by_kind: dict[int, set[int]] = {kind(s, op): set() for s in mixed
                                        for op in (Op.B, Op.I, Op.W)}
        for k, kd in zip(found.keys, found.kinds, strict=True):
            if kd in by_kind:
                by_kind[kd].add(k // found.span)
        for s in mixed:
            b_set, i_set, w_set = (by_kind[kind(s, op)] for op in (Op.B, Op.I, Op.W))
            if b_set & i_set or w_set != i_set:
                return False
    return not batched or any(a.version is not None for row in schedule.actions for a in row)


def _check_actions(schedule: Schedule) -> None:
    """Every action is in range, on the rank holding its stage, and appears once."""
    seen: Counter[Key] = Counter()
    total = schedule.total_microbatches
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            here = {rank: i}
            if a.stage >= schedule.num_stages:
                raise _fail(schedule, f"{a}: stage {a.stage} >= num_stages "
                            f"{schedule.num_stages}", here)
            limit = (schedule.num_stages if a.op in _BY_STAGE
                     else schedule.num_batches if a.op in _BY_BATCH else total)
            if a.microbatch >= limit:
                what = ("stage" if a.op in _BY_STAGE else "batch" if a.op in _BY_BATCH
                        else "micro-batch")
                raise _fail(schedule, f"{a}: {what} {a.microbatch} is out of range (< {limit})",
                            here)
            if schedule.rank_of(a.stage) != rank:
                raise _fail(
                    schedule,
                    f"{a}: stage {a.stage} is placed on rank {schedule.rank_of(a.stage)} "
                    f"({schedule.placement} placement) but the action is on rank {rank}",
                    here,
                )
            key = (a.stage, a.op, a.microbatch)
            seen[key] += 1
            if seen[key] > 1:
                raise _fail(schedule, f"{a} appears more than once", here)


def _check_complete(schedule: Schedule) -> None:
    """Each (stage, micro-batch) has one F and one B, or one I and one W; 2BW: one U per batch."""
    present = {(a.stage, a.op, a.microbatch) for row in schedule.actions for a in row}
    versioned = any(a.version is not None for row in schedule.actions for a in row)
    has_updates = any(a.op is Op.U for row in schedule.actions for a in row)
    for s in range(schedule.num_stages):
        for m in range(schedule.total_microbatches):
            if (s, Op.F, m) not in present:
                raise _fail(schedule, f"missing forward {s}F{m} (stage {s}, micro-batch {m})")
            full = (s, Op.B, m) in present
            split = ((s, Op.I, m) in present, (s, Op.W, m) in present)
            if full and any(split):
                raise _fail(schedule, f"stage {s} micro-batch {m} has both B and I/W backward",
                            _where(schedule, (s, Op.B, m)))
            if not full and split != (True, True):
                part = "I" if not split[0] else "W"
                raise _fail(schedule, f"missing backward for stage {s} micro-batch {m}: "
                            f"need {s}B{m}, or both {s}I{m} and {s}W{m} (no {s}{part}{m})")
        if has_updates or schedule.num_batches > 1:
            for b in range(schedule.num_batches):
                if (s, Op.U, b) not in present:
                    raise _fail(schedule, f"missing weight update {s}U{b} (stage {s}, batch {b})")
    if (has_updates or schedule.num_batches > 1) and not versioned:
        raise _fail(schedule, "a multi-batch (2BW) schedule must tag F/B/I/W with weight versions")


def _check_versions(schedule: Schedule) -> None:
    """2BW: batch b computes with version b; a micro-batch's F and backward share it; <= 2 live.

    Versions 0 and 1 exist at the start (the previous and the current weights); update U(s, b)
    turns version b + 1 and batch b's gradients into version b + 2, and version b is dropped once
    batch b's backward passes are done. Counted along each rank's order, per stage.
    """
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if a.op in (Op.F, Op.B, Op.I, Op.W):
                want = schedule.batch_of(a.microbatch)
                if a.version != want:
                    raise _fail(schedule, f"{a}: micro-batch {a.microbatch} is in batch {want} "
                                f"and must compute with weight version {want}, not "
                                f"{a.version}", {rank: i})
            elif a.op is Op.U and a.version is not None:
                raise _fail(schedule, f"{a}: an update carries no version tag", {rank: i})
    per_batch = schedule.num_microbatches
    for rank, row in enumerate(schedule.actions):
        for stage in schedule.stages_of(rank):
            live = {0, 1}
            pending: Counter[int] = Counter()  # version -> backward passes still to run
            forwarded: Counter[int] = Counter()
            for i, a in enumerate(row):
                if a.stage != stage or a.op is Op.I:
                    continue
                v = a.version
                if a.op is Op.F and v is not None:
                    if v not in live:
                        raise _fail(schedule, f"{a}: weight version {v} is not live on stage "
                                    f"{stage} here (live: {sorted(live)})", {rank: i})
                    pending[v] += 1
                    forwarded[v] += 1
                elif a.op in (Op.B, Op.W) and v is not None:
                    pending[v] -= 1
                    if pending[v] == 0 and forwarded[v] == per_batch and v != max(live):
                        live.discard(v)  # batch v is done with it, and it is not the newest
                elif a.op is Op.U:
                    live.add(a.microbatch + 2)
                    if len(live) > 2:
                        raise _fail(schedule, f"{a}: would hold {len(live)} weight versions "
                                    f"{sorted(live)} on stage {stage}; 2BW keeps at most two",
                                    {rank: i})


def _check_comms(schedule: Schedule) -> None:
    """A lowered schedule: each cross-rank message has one SEND and one RECV, nothing else is
    sent, and between each pair of ranks the receiver posts in the order the sender sends."""
    n = schedule.num_stages
    rank_of = schedule.rank_of
    sends: dict[tuple[int, int], list[tuple[Message, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[Message, int]]] = {}
    needed: dict[Message, tuple[int, int]] = {}  # message -> (rank, position) of its consumer
    for rank, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            op = a.op
            if op in _CONSUMERS:
                msg = consumed(a, n)
                if msg is not None and rank_of(source_stage(msg)) != rank:
                    needed[msg] = (rank, i)
                continue
            if op not in COMM_OPS:
                continue  # a local sync
            msg = message(a)
            if not 0 <= msg[1] < n or not 0 <= source_stage(msg) < n:
                raise _fail(schedule, f"{a}: it would move data from stage {source_stage(msg)} "
                            f"to stage {msg[1]}, outside stages 0..{n - 1}", {rank: i})
            src, dst = rank_of(source_stage(msg)), rank_of(msg[1])
            if src == dst:
                raise _fail(schedule, f"{a}: stages {source_stage(msg)} and {msg[1]} are both on "
                            f"rank {src}; nothing crosses ranks there", {rank: i})
            side = sends if op in _SENDS else recvs
            side.setdefault((src, dst), []).append((msg, i))
    # Each pair's messages as a set, once: not once per message consumed (quadratic).
    moved = {what: {pair: {m for m, _ in msgs} for pair, msgs in side.items()}
             for what, side in (("RECV", recvs), ("SEND", sends))}
    for msg, (rank, i) in needed.items():
        src = rank_of(source_stage(msg))
        for what, where in (("RECV", rank), ("SEND", src)):
            if msg not in moved[what].get((src, rank), ()):
                raise _fail(schedule, f"{schedule.actions[rank][i]} needs data from rank {src} "
                            f"but the schedule has no {what} for it on rank {where}",
                            {rank: i})
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k, ((sent, i), (posted, j)) in enumerate(zip(out, into, strict=False)):
            if sent != posted:
                raise _fail(schedule,
                            f"rank {dst} posts receives from rank {src} out of order: message "
                            f"{k} rank {src} sends is {_name(sent)} but rank {dst}'s receive "
                            f"{k} expects {_name(posted)}. Messages between two ranks match in "
                            f"order: post receives in the order the peer sends",
                            {src: i, dst: j})
        if len(out) != len(into):
            extra, rank = (out[len(into)], src) if len(out) > len(into) else (
                into[len(out)], dst)
            raise _fail(schedule, f"{schedule.actions[rank][extra[1]]}: no matching "
                        f"{'RECV' if rank == src else 'SEND'} for it between ranks {src} and "
                        f"{dst}", {rank: extra[1]})


def _comms_ok(schedule: Schedule, found: Plan | None) -> bool:
    """`_check_comms` passes (False: it may not), for a schedule with a plan.

    The plan has every RECV a compute action needs, on its rank. What is left: each SEND and
    RECV moves data between stages on two ranks, and per pair of ranks the sender's SENDs and
    the receiver's RECVs name the same messages in the same order (a message named by the key
    of its RECV), so every RECV has its SEND.
    """
    if found is None:
        return False
    n = schedule.num_stages
    rank_of = [schedule.rank_of(s) for s in range(n)]
    span = found.span
    pair_of = [-1] * span  # per SEND or RECV kind, sender * num_ranks + receiver
    shift = [0] * span  # per SEND kind, the int key of its RECV minus its own
    for kd in set(found.kinds):
        s, op = stage_op(kd)
        if op in COMPUTE_OPS:
            continue
        come, into = {Op.SEND_F: (s, s + 1), Op.SEND_B: (s, s - 1),
                      Op.RECV_F: (s - 1, s), Op.RECV_B: (s + 1, s)}[op]
        if not (0 <= into < n and 0 <= come < n) or rank_of[come] == rank_of[into]:
            return False
        pair_of[kd] = rank_of[come] * schedule.num_ranks + rank_of[into]
        if op in _SENDS:
            shift[kd] = kind(into, Op.RECV_F if op is Op.SEND_F else Op.RECV_B) - kd
    sent: dict[int, list[int]] = {}
    posted: dict[int, list[int]] = {}
    for rank in range(schedule.num_ranks):
        start, end = found.offsets[rank], found.offsets[rank + 1]
        kinds = found.kinds[start:end]
        pairs = [pair_of[kd] for kd in kinds]
        named = [k + shift[kd] for k, kd in zip(found.keys[start:end], kinds, strict=True)]
        for pair in set(pairs) - {-1}:  # a rank sends on (rank, peer), receives on (peer, rank)
            side = sent if pair // schedule.num_ranks == rank else posted
            side[pair] = list(compress(named, map(eq, pairs, repeat(pair))))
    return sent == posted


def _name(msg: Message) -> str:
    kind, stage, mb = msg
    if kind in "TG":
        what = "tied weights" if kind == "T" else "tied weights' gradients"
        return f"{what} of stage {source_stage(msg)} for stage {stage}"
    what = "activations for" if kind == "F" else "gradients for"
    return f"{what} stage {stage}, micro-batch {mb}"


def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` and return it; raise `ScheduleError` showing the grid marked where it fails.

    Rules: actions in range and on the rank holding their stage, none repeated; every stage and
    micro-batch runs F once and B once (or I and W once); F(s,m) after F(s-1,m); B(s,m) after
    B(s+1,m) and F(s,m); W after I; 2BW weight versions; lowered schedules: one SEND and one
    RECV per cross-rank message, receives posted in each sender's order; programs: the syncs
    their `syncs` ask for, each on every rank it concerns, in order (see validate_syncs); and
    no deadlock when
    every rank runs its list in order, each compute action waiting for its data (sends never
    block).
    """
    found = plan(schedule)  # None: a check below fails, or the schedule deadlocks
    if not _actions_ok(schedule, found):
        _check_actions(schedule)
    if not _complete_ok(schedule, found):
        _check_complete(schedule)
    if any(a.version is not None for row in schedule.actions for a in row):
        _check_versions(schedule)
    if schedule.has_comms and not _comms_ok(schedule, found):
        _check_comms(schedule)
    if (schedule.syncs is not None and not schedule.syncs.empty) or any(
            a.op in SYNC_OPS for row in schedule.actions for a in row):
        check_syncs(schedule)
    result = execute_by_kind(schedule, lambda op, stage: 1.0)
    if not isinstance(result, tuple):
        lines = []
        for rank, (i, missing) in sorted(result.blocked.items()):
            want = ", ".join(f"{s}{op.value}{m}" for s, op, m in missing) or "nothing"
            lines.append(f"  rank {rank} step {i} ({schedule.actions[rank][i]}) waits for {want}")
        raise _fail(
            schedule,
            "deadlock: these ranks wait on each other (or on an action ordered after them):\n"
            + "\n".join(lines),
            {r: i for r, (i, _) in result.blocked.items()},
        )
    return schedule
