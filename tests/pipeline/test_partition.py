import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pipeline.partition import BalanceError, partition, split_sizes
from pipeline.profile import (
    balance_by_params,
    balance_by_size,
    balance_by_time,
    layer_params,
    layer_sizes,
)


def _brute_force(costs: list[float], k: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        edges = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@given(st.lists(st.integers(0, 50), min_size=1, max_size=10), st.integers(1, 5))
def test_partition_is_optimal(costs: list[int], k: int) -> None:
    if k > len(costs):
        with pytest.raises(BalanceError, match="use at most"):
            partition(costs, k)
        return
    sizes = partition(costs, k)
    assert len(sizes) == k and all(s >= 1 for s in sizes) and sum(sizes) == len(costs)
    edges = list(itertools.accumulate([0, *sizes]))
    worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))
    assert worst == _brute_force([float(c) for c in costs], k)


def test_partition_examples() -> None:
    # torchgpipe's block partition normalises the cheapest layer to zero; exact min-max does not.
    assert partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]
    assert partition([5, 1, 1, 1, 1, 5], 2) == [3, 3]
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    with pytest.raises(BalanceError, match=">= 0"):
        partition([1, -1], 1)


def test_balance_by_params_and_size() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.Linear(10, 10),
                          nn.Linear(10, 10))
    assert layer_params(model) == [10100.0, 0.0, 1010.0, 110.0, 110.0]
    # [1, 4] and [2, 3] both peak at 10100; ties keep the last stage (it computes the loss) short.
    assert balance_by_params(model, 2) == [2, 3]
    sizes = layer_sizes(model, torch.randn(8, 100))
    assert sizes[0] > sizes[2] > sizes[3] > 0
    assert sum(balance_by_size(model, torch.randn(8, 100), 3)) == 5


def test_balance_by_time_puts_the_slow_layer_alone() -> None:
    model = nn.Sequential(nn.Linear(512, 512), *[nn.Linear(512, 512) for _ in range(3)],
                          nn.Linear(512, 2))
    model[0] = nn.Sequential(*[nn.Linear(512, 512) for _ in range(24)])  # ~24x the others
    assert balance_by_time(model, torch.randn(64, 512), 2, repeats=5)[0] == 1
