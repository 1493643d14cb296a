"""Single-device references the pipelined runs are compared with."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipeline.runtime.recompute import stage_seed

__all__ = ["build", "grads_equal", "seeded_microbatch_step"]


def build(spec: dict[str, Any], *, dtype: torch.dtype = torch.float32
          ) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model, input and target a `sequential_specs` recipe describes (in `dtype`; the
    same values whatever the dtype, drawn in fp32 first)."""
    torch.manual_seed(spec["seed"])
    layers: list[nn.Module] = []
    width = spec["in"]
    for kind, out in spec["layers"]:
        if kind == "linear":
            layers.append(nn.Linear(width, out))
            width = out
        elif kind == "gelu":
            layers.append(nn.GELU())
        elif kind == "tanh":
            layers.append(nn.Tanh())
        elif kind == "layernorm":
            layers.append(nn.LayerNorm(width))
        else:
            layers.append(nn.Dropout(0.3))
    x = torch.randn(spec["batch"], spec["in"])
    y = torch.randn(spec["batch"], width)
    return nn.Sequential(*layers).to(dtype), x.to(dtype), y.to(dtype)


def seeded_microbatch_step(model: nn.Sequential, balance: Sequence[int], x: torch.Tensor,
                           target: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                           chunks: int, step_seed: int) -> torch.Tensor:
    """The plain loop Pipe must equal when layers draw random numbers: micro-batch by
    micro-batch, stage by stage, each stage's forward under its (step, stage, micro-batch)
    seed, losses weighted by micro-batch size, gradients accumulated."""
    layers = list(model)
    parts, start = [], 0
    for size in balance:
        parts.append(nn.Sequential(*layers[start:start + size]))
        start += size
    total = torch.zeros(())
    for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, chunks), torch.tensor_split(target,
                                                                                          chunks),
                                     strict=True)):
        h = xm
        for s, part in enumerate(parts):
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(stage_seed(step_seed, s, m))
                h = part(h)
        loss = loss_fn(h, ym) * (xm.shape[0] / x.shape[0])
        loss.backward()
        total = total + loss.detach()
    return total


def grads_equal(model: nn.Module, reference: nn.Module, loss: torch.Tensor,
                expected: torch.Tensor, what: str, tol: dict[str, float]) -> int:
    """Assert the loss, and every gradient this rank holds, equal the reference model's (by
    parameter name, within `tol`); returns how many gradients it checked."""
    torch.testing.assert_close(loss, expected.detach(), **tol, msg=lambda m: f"{what}: {m}")
    want = dict(reference.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, want[name].grad, **tol,
                                       msg=lambda m, n=name: f"{what}, {n}: {m}")
            checked += 1
    return checked
