"""pipeline.runtime.recompute: per-(step, stage, micro-batch) seeds, RNG replay, the flag."""

from __future__ import annotations

import threading

import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline.runtime.recompute import RngReplay, is_recomputing, recomputing, stage_seed

CPU = torch.device("cpu")


@given(st.integers(0, 2**62), st.integers(0, 63), st.integers(0, 1023))
def test_stage_seeds_are_63_bit_and_differ_between_neighbours(step: int, stage: int,
                                                              mb: int) -> None:
    seed = stage_seed(step, stage, mb)
    assert 0 <= seed < 2**63 and seed == stage_seed(step, stage, mb)
    neighbours = {stage_seed(step + 1, stage, mb), stage_seed(step, stage + 1, mb),
                  stage_seed(step, stage, mb + 1)}
    assert seed not in neighbours and len(neighbours) == 3


def test_replay_draws_the_same_numbers_and_restores_the_callers_stream() -> None:
    replay = RngReplay(CPU)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    first = replay.run((0, True), (42, 0, 1), lambda: torch.rand(5))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream did not move
    again = replay.run((0, True), (42, 0, 1), lambda: torch.rand(5))
    other = replay.run((0, True), (42, 0, 2), lambda: torch.rand(5))
    assert torch.equal(first, again) and not torch.equal(first, other)
    torch.manual_seed(stage_seed(42, 0, 1))
    assert torch.equal(first, torch.rand(5))  # exactly the seed's stream


def test_a_forward_that_draws_nothing_runs_without_the_lock_afterwards() -> None:
    """Pins an internal detail: stages that never draw from their device's generator are found
    out on their first forward and later run without seeding it (so they never serialise)."""
    replay = RngReplay(CPU)
    assert replay.run((3, (False,)), (5, 3, 0), lambda: torch.ones(2).sum()).item() == 2.0
    assert replay._draws == {(3, (False,)): False} and replay.quiet((3, (False,)))
    replay.run((4, (True,)), (5, 4, 0), lambda: torch.rand(1))
    assert replay._draws[(4, (True,))] is True and not replay.quiet((4, (True,)))


def test_recomputing_is_scoped_nested_and_per_thread() -> None:
    assert not is_recomputing()
    seen: list[bool] = []
    with recomputing():
        assert is_recomputing()
        with recomputing():
            assert is_recomputing()
        assert is_recomputing()  # the inner scope restores, not clears
        thread = threading.Thread(target=lambda: seen.append(is_recomputing()))
        thread.start()
        thread.join()
    assert not is_recomputing() and seen == [False]
