"""Lowering: the one place that decides who sends what to whom, and in which order.

A cross-rank data edge is a *message*: `("F", s, m)` carries the activations stage s - 1
hands to stage s for micro-batch m; `("B", s, m)` carries the input gradient stage s + 1 hands
back to stage s. Lowering adds, for each, a SEND on the producer's rank right after the producer
and a RECV on the consumer's rank no later than the consumer. A RECV posts the receive (it does
not block); the consumer waits for the data. Messages between a pair of ranks match in order
(gloo and NCCL have no usable tags), so for every (sender, receiver) pair the receiver's RECVs
come in the order of the sender's SENDs: a RECV moves earlier than its consumer when a message
sent before it is consumed after it.
"""

from __future__ import annotations

from collections.abc import Iterator

from schedules.ir import Action, Op, Schedule

__all__ = ["Message", "consumed", "lower", "message", "produced", "recv_action", "send_action",
           "source_stage"]

Message = tuple[str, int, int]  # (kind "F" or "B", consumer stage, micro-batch)

_SEND = {"F": Op.SEND_F, "B": Op.SEND_B}
_RECV = {"F": Op.RECV_F, "B": Op.RECV_B}


def consumed(action: Action, num_stages: int) -> Message | None:
    """The message from an adjacent stage that compute `action` needs (None: it needs none)."""
    if action.op is Op.F and action.stage > 0:
        return ("F", action.stage, action.microbatch)
    if action.op in (Op.B, Op.I) and action.stage < num_stages - 1:
        return ("B", action.stage, action.microbatch)
    return None


def produced(action: Action, num_stages: int) -> Message | None:
    """The message compute `action` produces for an adjacent stage (None: it produces none)."""
    if action.op is Op.F and action.stage < num_stages - 1:
        return ("F", action.stage + 1, action.microbatch)
    if action.op in (Op.B, Op.I) and action.stage > 0:
        return ("B", action.stage - 1, action.microbatch)
    return None


def source_stage(msg: Message) -> int:
    """The stage that produces `msg`."""
    kind, stage, _ = msg
    return stage - 1 if kind == "F" else stage + 1


def message(action: Action) -> Message:
    """The message a SEND or RECV action moves."""
    op, s, m = action.op, action.stage, action.microbatch
    if op is Op.SEND_F:
        return ("F", s + 1, m)
    if op is Op.SEND_B:
        return ("B", s - 1, m)
    if op is Op.RECV_F:
        return ("F", s, m)
    if op is Op.RECV_B:
        return ("B", s, m)
    raise ValueError(f"{action} is not a SEND or RECV")


def send_action(msg: Message) -> Action:
    kind, _, mb = msg
    return Action(source_stage(msg), _SEND[kind], mb)


def recv_action(msg: Message) -> Action:
    kind, stage, mb = msg
    return Action(stage, _RECV[kind], mb)


def _cross(schedule: Schedule, row: tuple[Action, ...], rank: int,
           which: str) -> Iterator[tuple[int, Message, int]]:
    """(position, message, peer rank) for each message a rank's compute actions receive
    (`which="in"`) or send (`"out"`) across ranks."""
    n = schedule.num_stages
    for i, a in enumerate(row):
        msg = consumed(a, n) if which == "in" else produced(a, n)
        if msg is None:
            continue
        peer = schedule.rank_of(source_stage(msg) if which == "in" else msg[1])
        if peer != rank:
            yield i, msg, peer


def lower(schedule: Schedule) -> Schedule:
    """Add point-to-point communication to a compute-only schedule (see the module docstring).

    A schedule that already has SEND/RECV actions is returned unchanged.
    """
    if schedule.has_comms:
        return schedule
    rows = schedule.actions
    # The order in which each rank sends to each peer: its producers' order.
    sent: dict[tuple[int, int], list[Message]] = {}
    for rank, row in enumerate(rows):
        for _, msg, peer in _cross(schedule, row, rank, "out"):
            sent.setdefault((rank, peer), []).append(msg)
    lowered = []
    for rank, row in enumerate(rows):
        needed_at = {msg: i for i, msg, _ in _cross(schedule, row, rank, "in")}
        recvs: dict[int, list[Action]] = {}
        for (_, dst), msgs in sorted(sent.items()):
            if dst != rank:
                continue
            # Walk the channel backwards: each RECV goes before its consumer and before the
            # RECV of the message sent after it.
            at = len(row)
            placed = []
            for msg in reversed(msgs):
                at = min(at, needed_at[msg])
                placed.append((at, msg))
            for at, msg in reversed(placed):
                recvs.setdefault(at, []).append(recv_action(msg))
        out: list[Action] = []
        for i, a in enumerate(row):
            out += recvs.get(i, ())
            out.append(a)
            out_msg = produced(a, schedule.num_stages)
            if out_msg is not None and schedule.rank_of(out_msg[1]) != rank:
                out.append(send_action(out_msg))
        lowered.append(tuple(out))
    return schedule.replace(actions=tuple(lowered))
