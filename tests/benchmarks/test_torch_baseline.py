"""benchmarks.torch_baseline: which peer runs where, and why not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

import schedules
from benchmarks.config import stages_per_rank
from benchmarks.torch_baseline import TORCH_PEERS, TorchPipeline, peer_stages, unsupported
from pipeline import Pipe
from pipeline.launch import spawn
from tests.limits import SPAWN_TIMEOUT
from tests.torch_csv import build, torch_csv
from tests.torch_csv import unsupported as torch_refuses


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


def peer_memory(rank: int, cases: list[tuple[str, int]]) -> list[dict[str, list[int]]]:
    """Run on spawned ranks: torch's peer of each (schedule, m), its memory step (checking
    that the step still trains: each stage's gradients as one device's), and for gpipe our
    Pipe's own count on the same stages."""
    torch.manual_seed(0)
    out = []
    for schedule, m in cases:
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        reference = copy.deepcopy(model)
        x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
        nn.MSELoss()(reference(x), y).backward()
        p = torch.distributed.get_world_size()
        k = 4 // p if TORCH_PEERS[schedule] in ("ScheduleZBVZeroBubble",
                                                "ScheduleInterleaved1F1B") else 1
        peer = TorchPipeline(model, [4 // (p * k)] * (p * k), schedule=schedule, rank=rank,
                             num_ranks=p, num_microbatches=m, loss_fn=nn.MSELoss(),
                             device=torch.device("cpu"))
        counted = peer.memory_step(x, y)
        if schedule == "gpipe":  # ours on the same partition, counting its own stash
            pipe = Pipe(copy.deepcopy(model), [4 // p] * p, chunks=m, schedule="gpipe",
                        checkpoint="never", track_memory=True)
            pipe.step(x, y, nn.MSELoss())
            counted["ours"] = [s["peak_stashed_bytes"] for s in pipe.memory_stats()]
        out.append(counted)
        assert "forward_one_chunk" not in vars(peer.stages[0])  # the class's method again
        expected = dict(reference.named_parameters())
        for stage in peer.stages:
            for i, layer in enumerate(stage.submod):
                index = list(model).index(layer)
                torch.testing.assert_close(layer.weight.grad, expected[f"{index}.weight"].grad,
                                           rtol=1e-5, atol=1e-6, msg=f"{schedule} stage {i}")
    return out


@pytest.mark.dist
def test_torch_peak_memory_is_counted_as_ours() -> None:
    """Torch's peers hold what their schedules say: GPipe all m micro-batches on every rank,
    1F1B p - r, ZB-V what its own order gives (our count of torch's pipeline_order)."""
    cases = [("gpipe", 4), ("1f1b", 4), ("zb-v", 4), ("interleaved", 4)]
    results = spawn(peer_memory, 2, cases, timeout=SPAWN_TIMEOUT)
    peaks = {s: [r[i]["peak_stashed_microbatches"][0] for r in results]
             for i, (s, _) in enumerate(cases)}
    assert peaks["gpipe"] == [4, 4]
    assert peaks["1f1b"] == [2, 1]
    for s in ("zb-v", "interleaved"):
        order = schedules.loads_csv(torch_csv(TORCH_PEERS[s], 2, 4, comms=False))
        assert peaks[s] == list(schedules.peak_activations(order.actions)), s
    # Bytes: what our Pipe counts for the same stages and micro-batches.
    for r in results:
        assert r[0]["peak_stashed_bytes"] == r[0]["ours"]
