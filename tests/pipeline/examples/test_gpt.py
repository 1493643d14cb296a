"""pipeline.examples.gpt: shapes, causality, the tied head, GPT-2's init, one step that learns."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeline.examples.gpt import Block, Embedding, Head, gpt, lm_loss

VOCAB, CONTEXT, WIDTH, DEPTH, HEADS = 11, 8, 16, 2, 4


def _model(*, tied: bool = True, dropout: float = 0.1) -> nn.Sequential:
    torch.manual_seed(0)
    return gpt(VOCAB, context=CONTEXT, width=WIDTH, depth=DEPTH, heads=HEADS, dropout=dropout,
               tied=tied)


def _batch(rows: int = 3, length: int = CONTEXT) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(1))


def test_layout_and_shapes() -> None:
    model = _model().eval()
    assert isinstance(model[0], Embedding) and isinstance(model[-1], Head)
    assert all(isinstance(layer, Block) for layer in model[1:DEPTH + 1])
    assert isinstance(model[-2], nn.LayerNorm) and len(model) == DEPTH + 3
    ids = _batch()
    assert model[0](ids).shape == (3, CONTEXT, WIDTH)
    assert model(ids).shape == (3, CONTEXT, VOCAB)
    assert model(ids[:, :5]).shape == (3, 5, VOCAB)  # shorter than the context is fine


def test_longer_than_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than the model's context of 8"):
        _model()(_batch(length=CONTEXT + 1))


def test_causal_a_token_changes_no_earlier_logits() -> None:
    model = _model().eval()
    ids = _batch()
    t = 5
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])


def test_head_is_tied_to_the_token_embedding() -> None:
    model = _model()
    assert model[-1].weight is model[0].wte.weight
    assert isinstance(model[-1].weight, nn.Parameter)
    # counted once among the parameters, as GPT-2's lm_head
    assert sum(p is model[0].wte.weight for p in model.parameters()) == 1
    untied = _model(tied=False)
    assert untied[-1].weight is not untied[0].wte.weight
    assert untied[-1].weight.shape == untied[0].wte.weight.shape == (VOCAB, WIDTH)


def test_head_refuses_a_weight_of_the_wrong_shape_or_kind() -> None:
    with pytest.raises(ValueError, match=r"\(vocab, width\) = \(11, 16\)"):
        Head(VOCAB, WIDTH, weight=nn.Parameter(torch.zeros(WIDTH, VOCAB)))
    with pytest.raises(TypeError, match="Parameter itself"):
        Head(VOCAB, WIDTH, weight=torch.zeros(VOCAB, WIDTH))


def test_gpt2_init() -> None:
    torch.manual_seed(0)
    depth = 4
    model = gpt(256, context=64, width=256, depth=depth, heads=4)

    def std(t: torch.Tensor) -> float:
        return t.detach().std().item()

    assert std(model[0].wte.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model[0].wpe.weight) == pytest.approx(0.02, rel=0.05)
    block = model[1]
    assert std(block.attn.qkv.weight) == pytest.approx(0.02, rel=0.05)
    assert std(block.mlp.fc.weight) == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / math.sqrt(2 * depth)
    assert std(block.attn.proj.weight) == pytest.approx(scaled, rel=0.05)
    assert std(block.mlp.proj.weight) == pytest.approx(scaled, rel=0.05)
    assert all(not b.bias.any() for b in (block.attn.qkv, block.mlp.fc, block.mlp.proj))
    assert torch.equal(model[-2].weight, torch.ones(256))


def test_one_sgd_step_lowers_the_loss() -> None:
    model = _model(dropout=0.0)
    data = _batch(rows=4, length=CONTEXT + 1)
    x, y = data[:, :-1], data[:, 1:]
    loss = lm_loss(model(x), y)
    assert loss.item() == pytest.approx(math.log(VOCAB), rel=0.1)  # near uniform at init
    loss.backward()
    assert model[0].wte.weight.grad is not None  # from both uses: lookup and head
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    with torch.no_grad():
        assert lm_loss(model(x), y).item() < loss.item()


def test_lm_loss_is_the_mean_over_every_token() -> None:
    logits = torch.randn(2, 3, VOCAB)
    targets = torch.randint(0, VOCAB, (2, 3))
    expected = torch.stack([nn.functional.cross_entropy(logits[b, t], targets[b, t])
                            for b in range(2) for t in range(3)]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), expected)
