"""Models of random graph shape (tests/strategies.py's `stage_graphs`): branches, side inputs,
values crossing stages, parameters shared by layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["GraphLayer", "build_graph", "graph_loss"]


class GraphLayer(nn.Module):
    """One layer of a drawn graph: takes `(*slots, ids)`, rewrites slots by its ops, returns
    `(*slots, ids)`. Holds the pool's parameters it uses under `w<k>` (the same objects as the
    other layers that use them: ties across stages)."""

    def __init__(self, ops: list[tuple[Any, ...]], pool: list[nn.Parameter]) -> None:
        super().__init__()
        self.ops = [tuple(op) for op in ops]
        for op in self.ops:
            if op[0] in ("linear", "embed", "fresh"):
                setattr(self, f"w{op[-1]}", pool[op[-1]])

    def forward(self, values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        *slots, ids = values
        for op in self.ops:
            kind = op[0]
            if kind == "linear":
                _, src, dst, k = op
                slots[dst] = torch.tanh(slots[src] @ getattr(self, f"w{k}"))
            elif kind == "embed":
                _, dst, k = op
                slots[dst] = slots[dst] + getattr(self, f"w{k}")[ids]
            elif kind == "fresh":  # broadcast over the rows, as a position embedding is
                _, dst, k = op
                weight = getattr(self, f"w{k}")
                slots[dst] = weight.sum(0).expand(ids.shape[0], -1)
            elif kind == "mul":
                _, a, b, dst = op
                slots[dst] = slots[a] * slots[b]
            elif kind == "add":
                _, a, b, dst = op
                slots[dst] = slots[a] + slots[b]
            else:
                _, src, dst = op
                slots[dst] = slots[src]
        return (*slots, ids)


def build_graph(spec: dict[str, Any], *, dtype: torch.dtype = torch.float64
                ) -> tuple[nn.Sequential, tuple[torch.Tensor, ...], torch.Tensor]:
    """The model, input `(*slots, ids)` and target a `stage_graphs` recipe describes."""
    generator = torch.Generator().manual_seed(spec["seed"])
    width, rows = spec["width"], spec["rows"]

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    pool = [nn.Parameter(draw(width, width)) for _ in range(spec["pool"])]
    model = nn.Sequential(*(GraphLayer(ops, pool) for ops in spec["layers"]))
    slots = tuple(draw(rows, width) for _ in range(spec["slots"]))
    ids = torch.randint(0, width, (rows,), generator=generator)
    return model, (*slots, ids), draw(rows, width)


def graph_loss(out: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """Every slot against the target, each a mean over its rows (micro-batches weigh by rows)."""
    *slots, _ = out
    return sum((nn.functional.mse_loss(s, target) for s in slots),
               start=torch.zeros((), dtype=target.dtype))
