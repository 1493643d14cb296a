"""A rank's actions bound once per program: each action's handler, its message and peer resolved."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from schedules import COMM_OPS, Action, Op
from schedules.lower import Message, message, source_stage

__all__ = ["Bound", "Handler", "Plans"]

Handler = Callable[[Action, Any, Any], None]  # (action, step inputs, step result)
# An action, what runs it, and whether it moves a message (its time is not compute).
Bound = tuple[Action, Handler, bool]

_SENDS = frozenset({Op.SEND_F, Op.SEND_B})
_RECVS = frozenset({Op.RECV_F, Op.RECV_B, Op.RECV_T, Op.RECV_G})


class Plans:
    """The bound actions of each action list a rank has run, kept while the list lives.

    A Pipe runs the same few programs step after step (`Programs` caches them), so what each
    action needs besides the step's data (its handler, and for a SEND or RECV the message and
    the peer's rank) is looked up once per program instead of once per action and step.
    """

    def __init__(self, handlers: Mapping[Op, Handler],
                 send: Callable[[Message, int, Action, Any, Any], None],
                 post: Callable[[Message, int, Action, Any, Any], None],
                 rank_of: Callable[[int], int]) -> None:
        self._handlers = handlers
        self._send, self._post, self._rank_of = send, post, rank_of
        # id(actions) -> (actions, bound): the list is held, so its id stays its own.
        self._bound: dict[int, tuple[Sequence[Action], list[Bound]]] = {}

    def of(self, actions: Sequence[Action]) -> list[Bound]:
        """`actions` bound: from the cache when this very list was bound before."""
        hit = self._bound.get(id(actions))
        if hit is not None and hit[0] is actions:
            return hit[1]
        bound = [self._bind(a) for a in actions]
        if len(self._bound) >= 64:  # programs of many step shapes: keep the recent ones
            self._bound.clear()
        self._bound[id(actions)] = (actions, bound)
        return bound

    def _bind(self, action: Action) -> Bound:
        op = action.op
        handler: Handler
        if op in _SENDS:
            msg = message(action)
            handler = functools.partial(self._send, msg, self._rank_of(msg[1]))
        elif op in _RECVS:  # a tie's RECV too: its handler is the runtime's post
            msg = message(action)
            handler = functools.partial(self._post, msg, self._rank_of(source_stage(msg)))
        else:
            handler = self._handlers[op]
        return action, handler, op in COMM_OPS
