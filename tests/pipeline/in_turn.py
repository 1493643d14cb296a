"""Several scenarios on one set of spawned ranks, in turn: each set of ranks costs seconds to
start (every rank imports torch and joins the group; 4 ranks on 2 cores take about 8 s), often
more than the scenario it runs. The scenarios are the worker functions the tests would spawn
one by one, each returning what the test checks; a test reads its own scenario's results.

A scenario that raises on any rank ends the run there (the others cannot go on: their peers
would be in another scenario's collectives), and every test of the run then fails with the
ranks' errors, which name the scenario that failed. Scenarios that kill a rank, or expect a
failure to spread over the ranks, keep their own spawn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pipeline.launch import RankFailed, spawn
from tests.limits import IN_TURN_TEST_TIMEOUT, IN_TURN_TIMEOUT

__all__ = ["InTurn", "Scenario", "in_turn", "ranks", "run_in_turn"]

Scenario = tuple[str, Callable[..., Any], tuple[Any, ...]]  # name, fn(rank, *args), args


def run_in_turn(rank: int, scenarios: list[Scenario]) -> dict[str, Any]:
    """Each scenario's `fn(rank, *args)` in turn on this rank; their results by name."""
    # What a fresh process starts from: scenarios that build a model unseeded rely on every
    # rank building the same one, and an earlier scenario may have drawn per rank.
    fresh = torch.get_rng_state()
    results = {}
    for name, fn, args in scenarios:
        torch.set_rng_state(fresh)
        try:
            results[name] = fn(rank, *args)
        except Exception as exc:
            raise RuntimeError(f"scenario {name!r} failed on rank {rank}: "
                               f"{type(exc).__name__}: {exc}") from exc
    return results


class InTurn:
    """The scenarios, spawned on `nproc` ranks once, when a test first asks for a result (as
    a module-scoped fixture, so a run of some of the module's tests runs them all)."""

    def __init__(self, nproc: int, scenarios: list[Scenario], timeout: float) -> None:
        self.nproc, self.scenarios, self.timeout = nproc, scenarios, timeout
        self._results: list[dict[str, Any]] | None = None
        self._failure: RankFailed | None = None

    def __call__(self, name: str) -> list[Any]:
        """Every rank's result of scenario `name`, in rank order."""
        assert name in [s[0] for s in self.scenarios], name
        if self._results is None and self._failure is None:
            try:
                self._results = spawn(run_in_turn, self.nproc, self.scenarios,
                                      timeout=self.timeout)
            except RankFailed as exc:
                self._failure = exc
        if self._failure is not None:
            pytest.fail(f"the ranks running scenarios {[s[0] for s in self.scenarios]} in "
                        f"turn failed (the failing scenario is named below), so {name!r} "
                        f"may not have run:\n{self._failure}", pytrace=False)
        assert self._results is not None
        return [r[name] for r in self._results]


# Each test of a run may be the first to ask, and so wait for them all.
in_turn = pytest.mark.timeout(IN_TURN_TEST_TIMEOUT)


def ranks(name: str, nproc: int, scenarios: list[Scenario]) -> Any:
    """A module-scoped fixture `name`: the `scenarios` in turn on `nproc` ranks (`InTurn`)."""

    @pytest.fixture(scope="module", name=name)
    def fixture() -> InTurn:
        return InTurn(nproc, scenarios, timeout=IN_TURN_TIMEOUT)

    return fixture
