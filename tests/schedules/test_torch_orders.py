"""Our zero-bubble and V-shape generators give torch 2.13's action orders, action for action.

torch builds a schedule's `pipeline_order` only around live stages in a process group, but
the per-rank generator behind it (`_calculate_single_rank_operations`) reads nothing beyond a
few sizes: we call it on a bare instance holding those, drop its idle cells and write each
`OVERLAP_F_B` as its forward then its backward.
"""

from __future__ import annotations

from typing import Any

import pytest

import schedules

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

_LETTER = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
PEERS = {"zb-h1": ("ScheduleInterleavedZeroBubble", 1),
         "zb-v": ("ScheduleZBVZeroBubble", 2),
         "dualpipe-v": ("ScheduleDualPipeV", 2)}


def _torch_rows(cls_name: str, stages_per_rank: int, p: int, m: int) -> list[str]:
    cls = getattr(torch_schedules, cls_name)
    peer: Any = cls.__new__(cls)
    rounds = max(1, m // p)
    for attr, value in {"pp_group_size": p, "_n_microbatches": m, "n_local_stages":
                        stages_per_rank, "num_stages": p * stages_per_rank,
                        "_num_stages": p * stages_per_rank, "number_of_rounds": rounds,
                        "microbatches_per_round": m // rounds}.items():
        setattr(peer, attr, value)
    out = []
    for rank in range(p):
        peer.rank = rank
        cells = []
        for action in peer._calculate_single_rank_operations(rank):
            if action is None:
                continue
            for a in action.sub_actions or (action,):
                cells.append(f"{a.stage_index}{_LETTER[a.computation_type.name]}"
                             f"{a.microbatch_index}")
        out.append(" ".join(cells))
    return out


@pytest.mark.parametrize("name", sorted(PEERS))
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_same_order_as_torch(name: str, p: int) -> None:
    cls_name, per_rank = PEERS[name]
    for m in range(1, 3 * p + 3):
        if name == "zb-h1" and m % max(1, m // p):
            continue  # torch refuses m not divisible by its rounds; ours takes any m
        if name == "dualpipe-v" and m < 2 * p:
            continue  # torch refuses m < 2p (ours leaves the missing micro-batches out)
        ours = schedules.get_schedule(name, p, m)
        got = [" ".join(str(a) for a in row) for row in ours.actions]
        assert got == _torch_rows(cls_name, per_rank, p, m), (name, p, m)
