"""Weights shared across stages (a language model's embedding and head): one owner, synced copies.

A `Parameter` used by several stages belongs to the lowest of them (its owner). Every other
stage that uses it holds a copy: a `Parameter` registered where the model had the shared one, so
the model's structure and `state_dict()` keys are what the user wrote, but left out of
`Pipe.parameters()`, so optimizers, clipping and counts see the weight once. Each step's program
(schedules/program.py) refreshes the copies with the owner's value before their first forward
(a copy on another rank receives it as a message of the schedule), and after the backward adds
each copy's gradient to the owner's and clears it. So the owner's `.grad` is the sum over every
use, as autograd leaves it on one device, and an optimizer steps the weight once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeline.errors import PipeConfigError
from pipeline.splitting import partition
from pipeline.splitting.traced import layer_key

__all__ = ["Copy", "Tie", "TieLink", "find_ties", "link", "register_hooks", "untie"]


@dataclass
class Copy:
    """One non-owner stage's use of a tied weight."""

    stage: int
    keys: list[str]  # the model's keys of this stage's uses (usually one)
    places: list[tuple[nn.Module, str]]  # (module, attribute) holding it in the stage
    param: nn.Parameter | None = None  # set by `untie` where the stage is held


@dataclass
class Tie:
    """A weight shared by several stages: its owner and the other stages' copies."""

    key: str  # the model's key of the owner's first use
    stage: int  # the owner stage (the lowest that uses it)
    param: nn.Parameter  # the shared object (on whatever device the model was built)
    copies: list[Copy] = field(default_factory=list)


def _uses(model: nn.Sequential) -> Iterator[tuple[int, str, nn.Module, str, nn.Parameter]]:
    """(layer index, model key, module, attribute, parameter) for every use of a parameter."""
    for i, name in enumerate(model._modules):
        layer = model._modules[name]
        assert layer is not None
        for path, module in layer.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is not None:
                    key = layer_key(model, name, ".".join(p for p in (path, attr) if p))
                    yield i, key, module, attr, p


def find_ties(model: nn.Sequential, balance: Sequence[int]) -> list[Tie]:
    """The parameters of `model` used by more than one stage of `balance`, in model order."""
    stage_of = partition.stage_of(balance)
    ties: dict[int, Tie] = {}
    stages_seen: dict[int, dict[int, Copy | None]] = {}
    holders: dict[int, tuple[int, str]] = {}  # id(module) -> (stage, key) of its first use
    for i, key, module, attr, p in _uses(model):
        s = stage_of[i]
        first = holders.setdefault(id(module), (s, key))
        if first[0] != s:
            raise PipeConfigError(
                f"{key!r} (stage {s}) and {first[1]!r} (stage {first[0]}) are the same "
                f"{type(module).__name__} object, used by two stages: Pipe ties Parameters "
                f"across stages, not whole modules. Build a second module that shares the "
                f"weight (e.g. head.weight = embedding.weight), or keep both uses in one stage "
                f"(adjust balance)")
        seen = stages_seen.setdefault(id(p), {})
        if not seen:
            seen[s] = None
            ties[id(p)] = Tie(key, s, p)
            continue
        tie = ties[id(p)]
        if s == tie.stage:
            continue  # a second use inside the owner stage: autograd sums it as it is
        copy = seen.get(s)
        if copy is None:
            copy = seen[s] = Copy(s, [], [])
            tie.copies.append(copy)
        copy.keys.append(key)
        copy.places.append((module, attr))
    return [t for t in ties.values() if t.copies]


def untie(ties: Sequence[Tie], local_stages: Sequence[int]) -> None:
    """Give each held non-owner stage its own copy `Parameter` in place of the shared one."""
    for tie in ties:
        for copy in tie.copies:
            if copy.stage not in local_stages:
                continue
            copy.param = nn.Parameter(tie.param.detach().clone(),
                                      requires_grad=tie.param.requires_grad)
            for module, attr in copy.places:
                module._parameters[attr] = copy.param


@dataclass
class TieLink:
    """Moves tied weights and their gradients between the owner and the copies, one *link*
    (owner stage, copy stage) at a time, as the program's tie actions say (the TieOps of
    pipeline/runtime/syncs.py): the values a link carries, and its gradients, are all the
    weights the two stages share, in the ties' order.

    `owners` holds the owners' live Parameters where this process holds them.
    """

    ties: Sequence[Tie]
    owners: dict[int, nn.Parameter]  # id(tie) -> the owner's live Parameter, where held

    def copy_params(self) -> set[int]:
        """ids of the copies held here (left out of `Pipe.parameters()`)."""
        return {id(c.param) for t in self.ties for c in t.copies if c.param is not None}

    def refresh_local(self) -> None:
        """Copies whose owner is in this process take its value."""
        for tie in self.ties:
            owner = self.owners.get(id(tie))
            for copy in tie.copies:
                if owner is not None and copy.param is not None:
                    _take(copy.param, owner)

    def _link(self, owner: int, copy: int) -> list[tuple[Tie, Copy]]:
        return [(t, c) for t in self.ties if t.stage == owner for c in t.copies
                if c.stage == copy]

    def values(self, owner: int, copy: int) -> tuple[torch.Tensor, ...]:
        """The owner's values of the weights stage `copy` shares with stage `owner`."""
        return tuple(self.owners[id(t)].detach() for t, _ in self._link(owner, copy))

    def set_values(self, copy: int, owner: int, values: Sequence[Any]) -> None:
        """Stage `copy`'s copies take `values` (its owner's), with no gradient (a failed step
        may have left part of one)."""
        for (_, c), value in zip(self._link(owner, copy), values, strict=True):
            assert c.param is not None, f"stage {copy} is not held here"
            c.param.grad = None
            _take(c.param, value)

    def take_grads(self, copy: int, owner: int) -> tuple[torch.Tensor | None, ...]:
        """Stage `copy`'s gradients of the weights it shares with stage `owner`, cleared."""
        out = []
        for _, c in self._link(owner, copy):
            assert c.param is not None, f"stage {copy} is not held here"
            out.append(c.param.grad)
            c.param.grad = None
        return tuple(out)

    def add_grads(self, owner: int, copy: int, grads: Sequence[Any]) -> None:
        """Add a copy's gradients (None: it has none) to the owners' `.grad`."""
        for (t, _), grad in zip(self._link(owner, copy), grads, strict=True):
            _accumulate(self.owners[id(t)], grad)

    def retie(self) -> None:
        """Put each owner back where its copies held this process's uses (the Pipe closes):
        the model shares the weight again, with its current value. Copies whose owner lives
        on another rank stay (this rank's model is a part of the whole)."""
        for tie in self.ties:
            owner = self.owners.get(id(tie))
            for copy in tie.copies:
                if owner is not None and copy.param is not None:
                    for module, attr in copy.places:
                        module._parameters[attr] = owner
                    copy.param = None

    def state_dict_keys(self) -> tuple[dict[str, nn.Parameter], set[str]]:
        """Multi-process keys: (keys of copies held elsewhere, which this rank reports with
        its owner's value; keys of copies held here, left out because their owner is not)."""
        add: dict[str, nn.Parameter] = {}
        drop: set[str] = set()
        for tie in self.ties:
            owner = self.owners.get(id(tie))
            for copy in tie.copies:
                if owner is not None and copy.param is None:
                    add.update({k: owner for k in copy.keys})
                elif owner is None and copy.param is not None:
                    drop.update(copy.keys)
        return add, drop


def _accumulate(owner: nn.Parameter, grad: Any) -> None:
    if grad is None:
        return
    grad = grad.to(owner.device)
    if owner.grad is None:
        owner.grad = grad.clone()
    else:
        owner.grad.add_(grad)


def link(ties: Sequence[Tie], live: dict[str, nn.Parameter]) -> TieLink:
    """The `TieLink` of a Pipe whose held parameters are `live` (by the model's keys, after
    materialisation, which may have replaced meta Parameters)."""
    owners = {id(t): live[t.key] for t in ties if t.key in live}
    for tie in ties:
        for copy in tie.copies:
            if copy.param is not None:
                # Found where the copy was put, not by its key: in a model split from its
                # graph the owner's stage may hold the owner under the copy's key too (GPT-2's
                # embedding reads `lm_head.weight`), and the Pipe's tree shows the owner there.
                module, attr = copy.places[0]
                copy.param = module._parameters[attr]
    return TieLink(ties, owners)


def register_hooks(tie_link: TieLink) -> None:
    """Copies read through a `state_dict()` (the Pipe's or the user's model's) show their
    owner's current value, not the one of the last run."""
    for tie in tie_link.ties:
        for copy in tie.copies:
            if copy.param is None:
                continue
            for module in {id(m): m for m, _ in copy.places}.values():
                module.register_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                    lambda *_: tie_link.refresh_local())


def _take(copy: nn.Parameter, value: torch.Tensor) -> None:
    """`copy` takes the owner's `value`, in the owner's dtype: the copy is no child of the
    Pipe's tree (the owner is, under the same name), so `pipe.to(dtype)` converts only the
    owner, and the copy follows it here (same Parameter object, optimizers keep it)."""
    with torch.no_grad():
        if copy.dtype != value.dtype:
            copy.data = torch.empty_like(copy, dtype=value.dtype)
        copy.copy_(value)
