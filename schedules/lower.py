"""Lowering: the one place that decides who sends what to whom, and in which order.

A cross-rank data edge is a *message*: `("F", s, m)` carries the activations stage s - 1
hands to stage s for micro-batch m; `("B", s, m)` carries the input gradient stage s + 1 hands
back to stage s. A program's tied weights move as messages too (placed by schedules.program):
`("T", c, o)` carries owner stage o's tied weights to copy stage c, `("G", o, c)` the copy's
gradients back. Lowering adds, for each, a SEND on the producer's rank right after the producer
and a RECV on the consumer's rank no later than the consumer. A RECV posts the receive (it does
not block); the consumer waits for the data. Messages between a pair of ranks match in order
(gloo and NCCL have no usable tags), so for every (sender, receiver) pair the receiver's RECVs
come in the order of the sender's SENDs: a RECV moves earlier than its consumer when a message
sent before it is consumed after it.
"""

from __future__ import annotations

from schedules.ir import Action, Op, Schedule

__all__ = ["Message", "consumed", "lower", "message", "produced", "recv_action", "send_action",
           "source_stage"]

Message = tuple[str, int, int]  # (kind "F" or "B", consumer stage, micro-batch); ties: below

_SEND = {"F": Op.SEND_F, "B": Op.SEND_B, "T": Op.SEND_T, "G": Op.SEND_G}
_RECV = {"F": Op.RECV_F, "B": Op.RECV_B, "T": Op.RECV_T, "G": Op.RECV_G}
# Module names for the members: looking one up on the enum class costs several times more.
_F, _B, _I = Op.F, Op.B, Op.I
_SEND_F, _SEND_B, _RECV_F, _RECV_B = Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B


def consumed(action: Action, num_stages: int) -> Message | None:
    """The message from an adjacent stage that compute `action` needs (None: it needs none)."""
    op = action.op
    if op is _F:
        return ("F", action.stage, action.microbatch) if action.stage > 0 else None
    if (op is _B or op is _I) and action.stage < num_stages - 1:
        return ("B", action.stage, action.microbatch)
    if op is Op.TIE_SET:  # a copy stage takes the values of owner stage `microbatch`
        return ("T", action.stage, action.microbatch)
    if op is Op.TIE_ADD:  # an owner stage adds the gradients of copy stage `microbatch`
        return ("G", action.stage, action.microbatch)
    return None


def produced(action: Action, num_stages: int) -> Message | None:
    """The message compute `action` produces for an adjacent stage (None: it produces none)."""
    op = action.op
    if op is _F:
        return ("F", action.stage + 1, action.microbatch) if action.stage < num_stages - 1 else None
    if (op is _B or op is _I) and action.stage > 0:
        return ("B", action.stage - 1, action.microbatch)
    return None


def source_stage(msg: Message) -> int:
    """The stage that produces `msg`."""
    kind, stage, other = msg
    if kind == "F":
        return stage - 1
    return stage + 1 if kind == "B" else other  # a tie message names its source stage


def message(action: Action) -> Message:
    """The message a SEND or RECV action moves."""
    op, s, m = action.op, action.stage, action.microbatch
    if op is _SEND_F:
        return ("F", s + 1, m)
    if op is _SEND_B:
        return ("B", s - 1, m)
    if op is _RECV_F:
        return ("F", s, m)
    if op is _RECV_B:
        return ("B", s, m)
    if op is Op.SEND_T or op is Op.RECV_G:  # from or into the owner stage s
        return ("T", m, s) if op is Op.SEND_T else ("G", s, m)
    if op is Op.RECV_T or op is Op.SEND_G:  # into or from the copy stage s
        return ("T", s, m) if op is Op.RECV_T else ("G", m, s)
    raise ValueError(f"{action} is not a SEND or RECV")


def send_action(msg: Message) -> Action:
    kind, stage, mb = msg
    return Action(source_stage(msg), _SEND[kind], stage if kind in "TG" else mb)


def recv_action(msg: Message) -> Action:
    kind, stage, mb = msg
    return Action(stage, _RECV[kind], mb)


def _crossing(schedule: Schedule) -> tuple[list[list[tuple[int, Message, int]]],
                                            list[list[tuple[int, Message, int]]]]:
    """Per rank, (position, message, peer rank) for each message its compute actions receive
    from another rank, and for each they send to another rank."""
    n = schedule.num_stages
    rank_of = tuple(schedule.rank_of(s) for s in range(n))
    ins, outs = [], []
    for rank, row in enumerate(schedule.actions):
        got, put = [], []
        for i, a in enumerate(row):
            msg = consumed(a, n)
            # The source of a message into stage s: s - 1 for activations, s + 1 for gradients.
            if msg is not None and (peer := rank_of[msg[1] - 1 if msg[0] == "F"
                                                    else msg[1] + 1]) != rank:
                got.append((i, msg, peer))
            msg = produced(a, n)
            if msg is not None and (peer := rank_of[msg[1]]) != rank:
                put.append((i, msg, peer))
        ins.append(got)
        outs.append(put)
    return ins, outs


def lower(schedule: Schedule) -> Schedule:
    """Add point-to-point communication to a compute-only schedule (see the module docstring).

    A schedule that already has SEND/RECV actions is returned unchanged.
    """
    if schedule.has_comms:
        return schedule
    rows = schedule.actions
    ins, outs = _crossing(schedule)
    # The order in which each rank sends to each peer: its producers' order.
    sent: dict[tuple[int, int], list[Message]] = {}
    for rank, put in enumerate(outs):
        for _, msg, peer in put:
            sent.setdefault((rank, peer), []).append(msg)
    channels = sorted(sent.items())
    lowered = []
    for rank, row in enumerate(rows):
        needed_at = {msg: i for i, msg, _ in ins[rank]}
        recvs: dict[int, list[Action]] = {}
        for (_, dst), msgs in channels:
            if dst != rank:
                continue
            # Walk the channel backwards: each RECV goes before its consumer and before the
            # RECV of the message sent after it.
            at = len(row)
            placed = []
            for msg in reversed(msgs):
                needed = needed_at[msg]
                if needed < at:
                    at = needed
                placed.append((at, msg))
            for at, (kind, stage, mb) in reversed(placed):
                recvs.setdefault(at, []).append(Action(stage, _RECV[kind], mb))
        # A SEND follows its producer, the action at its position: same stage, same micro-batch.
        sends = {i: Action(row[i].stage, _SEND[kind], mb) for i, (kind, _, mb), _ in outs[rank]}
        out: list[Action] = []
        for i, a in enumerate(row):
            before = recvs.get(i)
            if before is not None:
                out += before
            out.append(a)
            after = sends.get(i)
            if after is not None:
                out.append(after)
        lowered.append(tuple(out))
    return schedule.replace(actions=tuple(lowered))
