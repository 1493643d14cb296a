"""benchmarks.torch_baseline: which peer runs where, and why not."""

from __future__ import annotations

from benchmarks.torch_baseline import TORCH_PEERS, unsupported


def test_every_compared_schedule_has_a_peer() -> None:
    assert TORCH_PEERS == {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                           "interleaved": "ScheduleInterleaved1F1B",
                           "zb-h1": "ScheduleInterleavedZeroBubble"}


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
