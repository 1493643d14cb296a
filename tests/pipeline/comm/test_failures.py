"""pipeline.comm.failures: poison flags and the watch over failure reports."""

from __future__ import annotations

import pytest

from pipeline.comm.failures import PipelineAborted, Watch, poison_flag, poisoned_rank, report


class _Store:
    """The store calls failure reports use: add, set, get, check."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.checks = 0

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        return all(k in self.data for k in keys)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_poison_names_its_rank_and_only_ranks_of_the_group(rank: int) -> None:
    flag = poison_flag(rank)
    assert flag < 0
    assert poisoned_rank(flag, 4) == rank
    assert poisoned_rank(flag, rank) is None  # a rank outside the group: not a poison
    assert poisoned_rank(0, 4) is None and poisoned_rank(1, 4) is None


def test_a_watch_raises_the_first_report_and_reads_the_store_at_most_every_period() -> None:
    store = _Store()
    watch = Watch(store, [10, 11], rank=0, every=100.0)
    watch.tick(1000.0)
    watch.tick(1050.0)  # within the period: the store is not read again
    assert store.checks == 1
    report(store, 11, "second rank failed first")
    report(store, 10, "later")
    with pytest.raises(PipelineAborted, match="second rank failed first") as caught:
        watch.check()
    assert caught.value.rank == 1  # the index among the watched ranks
    with pytest.raises(PipelineAborted):
        watch.tick(1200.0)
