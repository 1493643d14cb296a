"""benchmarks.torch_baseline: which peer runs where, and why not."""

from __future__ import annotations

import pytest

import schedules
from benchmarks.config import stages_per_rank
from benchmarks.torch_baseline import TORCH_PEERS, peer_stages, unsupported
from tests.torch_csv import build
from tests.torch_csv import unsupported as torch_refuses


def test_every_compared_schedule_has_a_peer() -> None:
    assert TORCH_PEERS == {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                           "interleaved": "ScheduleInterleaved1F1B",
                           "zb-h1": "ScheduleInterleavedZeroBubble",
                           "zb-v": "ScheduleZBVZeroBubble", "dualpipe-v": "ScheduleDualPipeV"}


def test_unsupported_says_why() -> None:
    assert unsupported("1f1b", 2, 4) is None
    assert unsupported("gpipe", 2, 1) is None
    assert "m >= p" in (unsupported("1f1b", 4, 2) or "").replace("micro-batches >= ranks",
                                                                 "m >= p")
    assert "no 2bw" in (unsupported("2bw", 2, 4) or "")
    # Interleaved schedules want m divisible by max(1, m // p): 5 micro-batches on 2 ranks
    # make 2 rounds, which 5 does not divide.
    assert "divisible" in (unsupported("interleaved", 2, 5) or "")
    assert unsupported("zb-h1", 2, 8) is None
    assert "m=3 < 4" in (unsupported("dualpipe-v", 2, 3) or "")
    assert unsupported("zb-v", 3, 1) is None


@pytest.mark.parametrize("ours", sorted(TORCH_PEERS))
def test_unsupported_is_what_torch_refuses(ours: str) -> None:
    """Our rules against torch's own constructors, p 1..4, m 1..8."""
    for p in range(1, 5):
        for m in range(1, 9):
            refused = torch_refuses(TORCH_PEERS[ours], p, m)
            assert (unsupported(ours, p, m) is None) == (refused is None), (p, m, refused)


@pytest.mark.parametrize("ours", sorted(TORCH_PEERS))
def test_peer_stages_are_torchs_placement_and_ours(ours: str) -> None:
    """Each rank holds the stages torch's class puts there, and, where our generator is
    registered, the stages ours puts there (same partition on the same ranks)."""
    peer = TORCH_PEERS[ours]
    registered = ours in schedules.available()
    # As the harness: our generator's stages per rank (torch's default until ours exists).
    k = stages_per_rank(ours) if registered else None
    for p in range(1, 5):
        sched = build(peer, p, 2 * p, k)
        mapping = getattr(sched, "stage_index_to_group_rank", None)
        num_stages = len(mapping) if mapping is not None else p
        for r in range(p):
            held = peer_stages(peer, r, p, num_stages)
            if mapping is not None:
                assert held == sorted(s for s, rank in mapping.items() if rank == r)
            else:
                assert held == [r]
            if registered:
                gen = schedules.info(ours)
                s = schedules.get_schedule(ours, p, 2 * p, **gen.options_for(
                    stages_per_rank=num_stages // p))
                assert s.stages_of(r) == tuple(held)
