"""pipeline.splitting.partition: the exact min-max contiguous split, and near-equal sizes."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.splitting.partition import (
    BalanceError,
    min_max_split,
    partition,
    partition_by_reach,
    split_sizes,
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


def _splits(n: int, k: int) -> list[list[int]]:
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        out.append([b - a for a, b in itertools.pairwise(edges)])
    return out


@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 4),
       st.lists(st.integers(0, 60), min_size=9, max_size=9), st.integers(0, 120))
def test_partition_within_a_limit_is_optimal(costs: list[int], k: int, memory: list[int],
                                             limit: int) -> None:
    # A per-stage limit on another quantity (memory: the layers' sum plus 10 per stage index,
    # so the limit depends on the stage's position too): the best split among those that fit.
    if k > len(costs):
        return

    def mem(part: int, start: int, stop: int) -> int:
        return sum(memory[start:stop]) + 10 * part

    def fits(part: int, start: int, stop: int) -> bool:
        return mem(part, start, stop) <= limit

    candidates = []
    for sizes in _splits(len(costs), k):
        edges = list(itertools.accumulate([0, *sizes]))
        if all(fits(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(edges))):
            candidates.append(max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    if not candidates:
        with pytest.raises(BalanceError, match="within its limit"):
            partition(costs, k, fits=fits)
        return
    sizes = partition(costs, k, fits=fits)
    edges = list(itertools.accumulate([0, *sizes]))
    assert all(fits(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(edges)))
    assert max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)) == min(candidates)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 4))
def test_min_max_split_with_position_dependent_costs(costs: list[int], k: int) -> None:
    if k > len(costs):
        with pytest.raises(BalanceError, match="between 1 and"):
            min_max_split(len(costs), k, lambda s, a, b: 0.0)
        return

    def cost(part: int, start: int, stop: int) -> float:
        return float(sum(costs[start:stop]) * (part + 1) + costs[start])

    sizes, worst = min_max_split(len(costs), k, cost)
    edges = list(itertools.accumulate([0, *sizes]))
    assert worst == max(cost(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(edges)))
    assert worst == min(max(cost(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(
        list(itertools.accumulate([0, *split]))))) for split in _splits(len(costs), k))


def test_partition_without_a_limit_is_unchanged() -> None:
    assert partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, fits=lambda s, a, b: True) == [5, 2, 2]
    # Stage 0 may hold at most 2 layers: the best split moves the cut.
    assert partition([5, 1, 1, 1, 1, 5], 2, fits=lambda s, a, b: s > 0 or b - a <= 2) == [2, 4]


@given(st.lists(st.one_of(st.integers(0, 3).map(float), st.floats(0.0, 1e6),
                          st.sampled_from([0.1, 0.2, 0.3, 1 / 3])), min_size=1, max_size=40),
       st.integers(1, 40))
def test_the_bisected_split_is_the_dynamic_programmes(costs: list[float], k: int) -> None:
    # partition() without a limit bisects instead of trying every cut: the same split, ties
    # (zeros, repeats, sums that round alike) broken the same way, and the same worst part.
    from pipeline.splitting.partition import _bisected_split

    if k > len(costs):
        return
    prefix = list(itertools.accumulate(costs, initial=0.0))
    by_every_cut = min_max_split(len(costs), k, lambda _, a, b: prefix[b] - prefix[a])
    assert _bisected_split(prefix, k) == by_every_cut


@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(1, 5),
       st.lists(st.integers(0, 60), min_size=12, max_size=12), st.integers(0, 150),
       st.lists(st.integers(0, 30), min_size=12, max_size=12))
def test_the_split_by_reach_is_the_limited_dynamic_programmes(
        costs: list[int], k: int, saved: list[int], limit: int, inputs: list[int]) -> None:
    # A stage's memory as the planner counts it: its first layer's input (any size) plus what
    # its layers save, times a count that depends on its position; more layers only add.
    if k > len(costs):
        return

    def fits(part: int, start: int, stop: int) -> bool:
        return inputs[start] + (k - part) * sum(saved[start:stop]) <= limit

    try:
        expected = partition(costs, k, fits=fits)
    except BalanceError:
        with pytest.raises(BalanceError, match="within its limit"):
            partition_by_reach(costs, k, fits)
        return
    assert partition_by_reach(costs, k, fits) == expected
