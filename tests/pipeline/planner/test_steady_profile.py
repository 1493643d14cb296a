"""A profile measures what a layer costs, not what the machine's other work costs."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from pipeline.planner import profile_model


@pytest.fixture
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as a CPU rank trains: the layer's work on the calling thread
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _Competing:
    """Threads that keep every core busy with matrix products (torch releases the GIL while
    it multiplies, so they take cores, not the interpreter), two per core."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._spin, daemon=True)
                        for _ in range(2 * (os.cpu_count() or 1))]

    def _spin(self) -> None:
        a = torch.randn(384, 384)
        while not self.stop.is_set():
            a @ a

    def __enter__(self) -> _Competing:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def _cost(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> float:
    costs = profile_model(model, x, y, nn.MSELoss(), repeats=5).at(x.shape[0])
    return sum(costs.forward) + sum(costs.backward)


def test_a_layers_cost_is_the_same_beside_busy_threads(one_thread: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x, y = torch.randn(128, 256), torch.randn(128, 256)
    idle = _cost(model, x, y)
    with _Competing():
        busy = _cost(model, x, y)
    # By the wall clock the busy profile reads several times the idle one (7.5x: its thread
    # waits for a core); by the thread's CPU time only what it shares with the others (caches,
    # a hyperthread's sibling) moves it: 0.96-1.24x in six pairs here, and once past 1.5x in a
    # full run of the planner's tests. 2x keeps room for that and still fails a wall clock.
    assert 1 / 2 < busy / idle < 2, (idle, busy)

