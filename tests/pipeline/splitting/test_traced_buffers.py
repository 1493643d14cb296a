"""Buffers several stages of a split model read: each stage holds the model's own buffer, the
Pipe shows it once under the model's key, and loading a state dict fills every stage's."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipeline import Pipe


class _Rotary(nn.Module):
    """Every block reads the model's frequency table (non-persistent, as rotary `inv_freq`)
    and a persistent scale."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(1.0, 9.0) / 8, persistent=False)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x)) * self.inv_freq.cos() + self.scale
        return x


def test_a_buffer_every_stage_reads_is_each_stages_and_the_models() -> None:
    torch.manual_seed(0)
    model, x, y = _Rotary(), torch.randn(8, 8), torch.randn(8, 8)
    reference = copy.deepcopy(model)
    pipe = Pipe(model, example_inputs=x, split_points=["blocks.1", "blocks.3"],
                devices=["cpu", "cpu", "cpu"], chunks=4)
    stages = [p[0] for p in pipe.partitions]
    assert all(s.inv_freq is model.inv_freq and s.scale is model.scale for s in stages)
    assert list(pipe.state_dict()) == [k for k in reference.state_dict()
                                       if k in pipe.state_dict()]
    assert set(pipe.state_dict()) == set(reference.state_dict())  # `scale` once, no inv_freq
    loss = pipe.step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    # fp32, micro-batch means summed in another order: rtol 1e-5.
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    state = reference.state_dict()
    state["scale"] = torch.full((8,), 2.0)
    pipe.load_state_dict(state)
    assert all(torch.equal(s.scale, torch.full((8,), 2.0)) for s in stages)
    pipe.close()
