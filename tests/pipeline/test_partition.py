"""pipeline.partition: the exact min-max contiguous split, and near-equal sizes."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.partition import BalanceError, partition, split_sizes


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
