"""benchmarks.torch_baseline: which peer runs where, and why not."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

import schedules
from benchmarks.torch_baseline import TORCH_PEERS, unsupported


def test_peers_are_ours_to_compare() -> None:
    assert set(TORCH_PEERS) <= set(schedules.available())  # a typo would compare nothing


@pytest.mark.parametrize("schedule", schedules.available())
def test_every_schedule_has_a_torch_peer_or_a_reason(schedule: str) -> None:
    peer = TORCH_PEERS.get(schedule)
    if peer is None:
        assert f"no {schedule} schedule" in (unsupported(schedule, 2, 4) or "")
        return
    cls = getattr(torch_schedules, peer, None)
    assert isinstance(cls, type) and issubclass(cls, torch_schedules._PipelineSchedule), peer
    # Several stages per rank take torch's multi-stage classes (one PipelineStage each).
    if schedules.info(schedule).stages_per_rank > 1:
        assert issubclass(cls, torch_schedules.PipelineScheduleMulti), peer


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
