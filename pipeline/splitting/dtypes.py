"""A dtype changed after the split: which tensors changed, agreed over ranks, and the model
holding them in the new dtype while it is captured again.

An exported graph bakes in the casts of the dtypes it saw (Llama's RMSNorm casts back to the
captured float32), so `pipe.to(torch.bfloat16)` or `model.double()` after the split needs a
graph captured in the new dtype. The stages' tensors say what changed: every tensor whose dtype
differs from the first capture's, by its name in the model. Under several processes each rank
sees only its own stages converted (another rank's stay as the model was built here), so the
ranks' changes are merged, and a capture gives the model the merged dtypes: the stages' own
tensors where they hold them, empty stand-ins of the new dtype for the others (export reads a
tensor's dtype and shape, never its values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.errors import PipeConfigError

__all__ = ["DtypeChange", "changes", "dtypes_of", "holding", "merged"]

Changes = dict[str, str]  # a tensor's name in the model -> its dtype now ("bfloat16")


def _internal(name: str) -> bool:
    """A stage's own attribute (a capture's constant or module kept whole), not the model's."""
    return name.split(".", 1)[0].startswith(("_train_", "_eval_"))


def _held(stages: Iterable[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    for stage in stages:
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            if not _internal(name):
                yield name, t


def dtypes_of(stages: Iterable[nn.Module]) -> dict[str, torch.dtype]:
    """The dtype of every tensor of the model the stages read, by its name in the model."""
    return {name: t.dtype for name, t in _held(stages)}


def changes(stages: Iterable[nn.Module], base: dict[str, torch.dtype]) -> Changes:
    """The tensors the stages hold in another dtype than `base` (the first capture's)."""
    return {name: _name(t.dtype) for name, t in _held(stages)
            if name in base and t.dtype != base[name]}


def merged(given: Sequence[Changes]) -> Changes:
    """The ranks' changes as one (each rank converted its own stages); a tensor two ranks hold
    in different new dtypes is refused."""
    out: Changes = {}
    for each in given:
        for name, dtype in each.items():
            if out.setdefault(name, dtype) != dtype:
                raise PipeConfigError(
                    f"ranks hold {name} in {out[name]} and in {dtype}: convert the model "
                    f"alike on every rank (pipe.to(dtype) on each)")
    return out


@dataclass(frozen=True)
class DtypeChange:
    """Why a batch needs a capture although its shapes fit one: the model's tensors are in
    dtypes no capture was made in (`changed`, against the first capture's `base`)."""

    changed: tuple[tuple[str, str], ...]
    base: str

    @classmethod
    def of(cls, changed: Changes, base: dict[str, torch.dtype]) -> DtypeChange:
        first = min(changed)
        return cls(tuple(sorted(changed.items())), _name(base[first]))

    @property
    def dtypes(self) -> list[str]:
        """The new dtypes, in order of first appearance."""
        return list(dict.fromkeys(d for _, d in self.changed))

    def __str__(self) -> str:
        name, dtype = self.changed[0]
        more = f" (and {len(self.changed) - 1} more tensors)" if len(self.changed) > 1 else ""
        return (f"{name}{more} is {dtype}, where the graph was captured with it in "
                f"{self.base}")

    @property
    def fix(self) -> str:
        dtype = self.dtypes[0]
        return (f"convert the model before splitting it (model.to(torch.{dtype}), then "
                f"Pipe(model, example_inputs=...)), or convert it back "
                f"(pipe.to(torch.{self.base}))")


@contextlib.contextmanager
def holding(model: nn.Module, stages: Iterable[nn.Module], changed: Changes) -> Iterator[None]:
    """Within it, `model` holds its tensors as the stages hold them (a stage's buffer
    converted where the model's module kept the old one), and in the dtypes `changed` gives
    where this process converted none (another rank's stages): empty tensors of that dtype
    stand in, untouched pages, no copy of any value. Restored afterwards."""
    held = dict(_held(stages))
    by_id: dict[int, Any] = {}
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for key, t in list(table.items()):
                if t is None:
                    continue
                new = by_id.get(id(t))
                if new is None:
                    new = _as_held(t, held.get(f"{prefix}.{key}" if prefix else key),
                                   changed.get(f"{prefix}.{key}" if prefix else key))
                    by_id[id(t)] = new
                if new is not t:
                    swapped.append((table, key, t))
                    table[key] = new
    try:
        yield
    finally:
        for table, key, t in reversed(swapped):
            table[key] = t


def _as_held(t: torch.Tensor, mine: torch.Tensor | None, want: str | None) -> torch.Tensor:
    """The tensor a capture sees for the model's `t`: this process's stage's (`mine`), in the
    agreed dtype `want` (an empty stand-in where neither holds it so)."""
    new = mine if mine is not None and (want is None or _name(mine.dtype) == want) else t
    if want is None or _name(new.dtype) == want:
        return new
    dtype = getattr(torch, want)
    assert isinstance(dtype, torch.dtype), want
    empty = torch.empty_like(t, dtype=dtype)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(empty, requires_grad=t.requires_grad)
    return empty


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
