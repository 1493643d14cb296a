"""pipeline.planner.link: a measured latency and time per byte between two ranks."""

from __future__ import annotations

import pytest

from pipeline.planner import Link, measure_link


def test_link_arithmetic() -> None:
    link = Link("gloo", 1e-5, 1e-9)
    assert link.time(1000) == pytest.approx(1e-5 + 1e-6)
    # Ring all-reduce: 2(n-1) messages of 1/n of the data each.
    assert link.allreduce(4000, 4) == pytest.approx(6 * (1e-5 + 1000 * 1e-9))
    assert link.allreduce(4000, 1) == 0.0
    assert Link.free().time(1 << 30) == 0.0
    with pytest.raises(ValueError, match="transport must be one of"):
        Link("carrier-pigeon", 0.0, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        Link("threads", -1.0, 0.0)
    # Collectives may take another way than a pipeline's messages (same-host links).
    split = Link("gloo", 1e-5, 1e-9, collective_latency=1e-4, collective_per_byte=2e-9)
    assert split.time(1000) == pytest.approx(1e-5 + 1e-6)
    assert split.allreduce(4000, 4) == pytest.approx(6 * (1e-4 + 1000 * 2e-9))


def test_the_fit_recovers_latency_and_time_per_byte() -> None:
    from pipeline.planner.link import _fit

    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 23]
    latency, per_byte = _fit([(float(n), 4e-5 + n * 3e-10) for n in sizes])
    assert latency == pytest.approx(4e-5) and per_byte == pytest.approx(3e-10)
    # 5% noise on the largest size moves the latency by far less than its own size.
    noisy = [(float(n), (4e-5 + n * 3e-10) * (1.05 if n == sizes[-1] else 1.0))
             for n in sizes]
    assert _fit(noisy)[0] == pytest.approx(4e-5, rel=0.5)


def test_threads_are_measured_through_the_pipes_own_transport() -> None:
    link = measure_link("threads", sizes=(1024, 1 << 20), repeats=5)
    assert link.transport == "threads"
    assert link.latency >= 0 and link.per_byte >= 0
    assert link.time(1 << 20) < 0.1  # a mailbox hand-off, not a copy


@pytest.mark.dist
@pytest.mark.slow
def test_gloo_is_measured_between_two_processes() -> None:
    # 64 MiB against 1 KiB, median of 9: a same-host copy of 64 MiB takes tens of
    # milliseconds, beyond what a busy machine adds to one small round trip's median (8 MiB,
    # about 2 ms through shared memory, once measured less than a loaded 1 KiB round trip).
    link = measure_link("gloo", sizes=(1024, 1 << 26), repeats=9)
    assert link.transport == "gloo"
    assert link.per_byte > 0  # loopback copies every byte
    assert link.time(1 << 20) > link.time(1024)
    # The pipeline's messages take a same-host link; the group's own path is measured too.
    assert link.collective_latency is not None and link.collective_per_byte is not None


def test_bad_measurements_are_refused() -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        measure_link("mpi")
    with pytest.raises(ValueError, match="at least two sizes"):
        measure_link("threads", sizes=(1024,))


def test_an_all_reduce_is_fitted_to_the_ring_model() -> None:
    from pipeline.planner.link import ring_fit

    # 4 ranks: 6 steps, each of 20 us and a quarter of the bytes at 2 ns/byte.
    samples = [(float(n), 6 * (2e-5 + n / 4 * 2e-9)) for n in (1 << 10, 1 << 20, 1 << 23)]
    latency, per_byte = ring_fit(samples, 4)
    assert latency == pytest.approx(2e-5) and per_byte == pytest.approx(2e-9)
    link = Link("gloo", latency, per_byte)
    assert link.allreduce(1 << 20, 4) == pytest.approx(samples[1][1])
    with pytest.raises(ValueError, match="at least two ranks"):
        ring_fit(samples, 1)


@pytest.mark.dist
@pytest.mark.slow
def test_an_all_reduce_is_measured_over_processes() -> None:
    from pipeline.planner import measure_allreduce

    # Two gloo processes on loopback; 8 MiB takes milliseconds, 1 KiB far less.
    link = measure_allreduce("gloo", ranks=2, sizes=(1024, 1 << 23), repeats=5)
    assert link.per_byte > 0 and link.collective_per_byte == link.per_byte
    assert link.allreduce(1 << 23, 2) > link.allreduce(1024, 2)
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        measure_allreduce("threads")
