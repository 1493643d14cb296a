"""pipeline.planner.costs: per-layer seconds and bytes at each micro-batch size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.planner import profile_model
from pipeline.runtime.saved_bytes import SavedBytes
from tests.models import lm_loss, small_cnn, tiny_lm


def test_profile_counts_each_layer_at_each_size() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    profile = profile_model(model, x, y, nn.MSELoss(), rows=[3, 12], repeats=1, warmup=0)
    assert sorted(profile.by_rows) == [3, 12] and profile.batch_rows == 12
    for rows, costs in profile.by_rows.items():
        assert costs.rows == rows
        assert all(t > 0 for t in costs.forward + costs.backward)
        # Layer inputs: x's rows, then the 32-wide hidden twice (float32).
        assert costs.input_bytes == (rows * 8 * 4, rows * 32 * 4, rows * 32 * 4)
        # What autograd saves, layer by layer, as the runtime counts it.
        with SavedBytes() as first:
            model[0](x[:rows])
        assert costs.saved_bytes[0] == first.bytes
        assert costs.saved_bytes[2] > 0  # the last layer holds the loss's saved tensors too
    small, large = profile.at(3), profile.at(12)
    assert large.saved_bytes[1] == 4 * small.saved_bytes[1]
    with pytest.raises(KeyError, match="profiled: \\[3, 12\\]"):
        profile.at(5)


def test_static_bytes_count_a_tied_weight_once_per_stage() -> None:
    model = tiny_lm(vocab=13, width=16, depth=2)
    ids = torch.randint(0, 13, (4, 8))
    profile = profile_model(model, ids, ids, lm_loss, repeats=1, warmup=0)
    wte = 13 * 16 * 4
    whole, trainable, tensors = profile.static_bytes(0, len(model))
    assert tensors == len(list(model.parameters()))
    assert whole == trainable == sum(p.numel() * 4 for p in model.parameters())
    head = profile.static_bytes(len(model) - 1, len(model))[0]
    assert head == wte  # the head's only weight is the embedding's
    assert profile.static_bytes(0, 1)[0] + profile.static_bytes(1, len(model))[0] == whole + wte


def test_profiling_leaves_the_model_as_it_was() -> None:
    model = small_cnn()
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile = profile_model(model, x, y, nn.CrossEntropyLoss(), rows=[2, 6], repeats=1)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert sum(profile.buffer_bytes) == sum(b.numel() * b.element_size()
                                            for b in model.buffers())


def test_bad_rows_are_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"rows must lie in 1\.\.4"):
        profile_model(model, x, x, nn.MSELoss(), rows=[8])
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_model(model, x, x, nn.MSELoss(), repeats=0)
