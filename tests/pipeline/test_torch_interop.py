"""Schedules cross between us and torch.distributed.pipelining both ways and train exactly:
ours exported (`dump_csv`) and run by torch 2.13's `_PipelineScheduleRuntime`, torch's read
(`load_csv`) and run by our Pipe, over 2 to 4 gloo processes, each against one device; and a
torch program ported to Pipe as docs/from-torch-pipelining.md says gives torch's per-micro-batch
losses and gradients bit for bit."""

from __future__ import annotations

import pytest

import schedules
from pipeline.launch import spawn
from schedules.csvio import torch_incompatibility
from tests.limits import SPAWN_TIMEOUT
from tests.pipeline import interop_workers
from tests.torch_csv import TORCH_CLASSES, build, unsupported

pytestmark = pytest.mark.dist

# Odd and even, below and above p; each spawn loops over all of them inside its ranks.
_MICROBATCHES = {2: (1, 2, 3, 5, 8), 3: (1, 2, 4, 7), 4: (1, 3, 6, 8)}


def _ours(p: int) -> list[tuple[str, int, dict[str, int]]]:
    """Every registered generator torch can run (by what its schedules hold, not by name)."""
    cases = []
    for name in schedules.available():
        gen = schedules.info(name)
        options = gen.options_for(stages_per_rank=gen.stages_per_rank)
        for m in _MICROBATCHES[p]:
            if torch_incompatibility(schedules.get_schedule(name, p, m, **options)) is None:
                cases.append((name, m, options))
    return cases


def _comms_csv(cls: str) -> bool:
    # Only the runtime classes lower their order to one with communication.
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    return isinstance(build(cls, 2, 4), _PipelineScheduleRuntime)


def _torch_cases(p: int) -> list[tuple[str, int, bool, int | None]]:
    """(class, m, with comms, stages per rank): each class as torch builds it by default, and
    its zero-bubble with one stage per rank too (the benchmarks' peer of zb-h1)."""
    cases: list[tuple[str, int, bool, int | None]] = []
    variants = [(cls, None) for cls in TORCH_CLASSES] + [("ScheduleInterleavedZeroBubble", 1)]
    for cls, k in variants:
        if cls == "Schedule1F1B":
            continue  # its pipeline_order is not what it runs: test_csvio rejects it
        for m in _MICROBATCHES[p]:
            if unsupported(cls, p, m) is None:  # torch refuses e.g. DualPipeV with m < 2p
                cases += [(cls, m, comms, k) for comms in (False, True)
                          if not comms or _comms_csv(cls)]
    return cases


@pytest.mark.parametrize("p", [2, 3, 4])
def test_exchange_both_ways_trains_exactly(p: int) -> None:
    ours, theirs = _ours(p), _torch_cases(p)
    names = {name for name, _, _ in ours}
    assert {"gpipe", "1f1b", "interleaved", "zb-h1"} <= names and "2bw" not in names
    assert {case[0] for case in theirs} == set(TORCH_CLASSES) - {"Schedule1F1B"}
    results = spawn(interop_workers.exchange, p, ours, theirs, timeout=SPAWN_TIMEOUT)
    expected = len(ours) * 2 + len(theirs)
    assert [len(done) for done in results] == [expected] * p


def test_a_torch_program_ported_to_pipe_is_bit_identical() -> None:
    """Was: Pipe had no `losses=`, nothing to port torch's per-micro-batch losses to. GPipe,
    1F1B and interleaved (two stages per rank, rank r holding r and r + 2) with torch's
    `scale_grads=True`, and Pipe with `checkpoint="never"`, on the same model and batch:
    `torch.equal` on every micro-batch loss and every gradient. Four equal micro-batches:
    Pipe weighs each loss by 1/4 before its backward where torch divides the summed
    gradients by 4 after, and a power of two scales every rounding alike."""
    cases = [("ScheduleGPipe", "gpipe", 1, 4), ("Schedule1F1B", "1f1b", 1, 4),
             ("ScheduleInterleaved1F1B", "interleaved", 2, 4)]
    results = spawn(interop_workers.ported, 2, cases, timeout=SPAWN_TIMEOUT)
    assert [len(done) for done in results] == [len(cases)] * 2
