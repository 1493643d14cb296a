"""The planner plans a model split from its graph as pieces, and its plan trains exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import pipeline
from pipeline import Pipe, plan

transformers = pytest.importorskip("transformers")


def _loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_a_plan_of_a_split_llama_trains_exactly() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (8, 12))
    inputs = {"input_ids": ids, "use_cache": False}
    pieces = pipeline.split(model, inputs,
                            split_points=[f"model.layers.{i}" for i in range(1, 4)])
    chosen = plan(pieces, inputs, ids, _loss, ranks=2, memory_per_rank=None,
                  schedules=["1f1b", "gpipe"], chunks=[2, 4], repeats=1)
    assert sum(chosen.balance) == len(pieces) == 4 and len(chosen.balance) == 2
    pipe = Pipe(pieces, **chosen.pipe_kwargs())
    loss = pipe.step(inputs, ids, _loss)
    expected = _loss(reference(**inputs), ids)
    expected.backward()
    # fp32, micro-batch means added in another order than the batch's mean: rtol 1e-5.
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6)
    pipe.close()
