import csv
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given

import schedules
from schedules import Schedule, ScheduleError
from tests.strategies import schedules_any

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


@given(schedules_any())
def test_csv_round_trips(schedule: Schedule) -> None:
    for s in (schedule, schedules.lower(schedule)):
        # On one rank the loop and v placements are the same; the CSV cannot tell them apart.
        back = schedules.loads_csv(schedules.dumps_csv(s), num_microbatches=s.num_microbatches,
                                   name=s.name,
                                   placement=s.placement if s.num_ranks == 1 else None)
        assert back == s


def test_empty_cells_are_idle_and_placement_is_inferred() -> None:
    text = "0F0,,0B0\n,1F0,1B0\n"
    s = schedules.validate(schedules.loads_csv(text))
    assert (s.num_ranks, s.num_stages, s.num_microbatches, s.placement) == (2, 2, 1, "loop")
    v = schedules.loads_csv("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n")
    assert v.placement == "v"
    schedules.validate(v)


def test_csv_errors_name_the_cell() -> None:
    with pytest.raises(ScheduleError, match="row 1 \\(rank 1\\), column 2"):
        schedules.loads_csv("0F0,0B0\n1F0,,1X0\n")
    with pytest.raises(ScheduleError, match="no actions"):
        schedules.loads_csv("\n\n")
    with pytest.raises(ScheduleError, match="no placement"):
        schedules.loads_csv("0F0,1F0\n1F0\n")


def _torch_interleaved(cls: Any, p: int, m: int, v: int) -> dict[int, list[Any]]:
    # Build torch's own pipeline_order without a process group: the generator only needs these.
    sched = object.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    return {r: sched._calculate_single_rank_operations(r) for r in range(p)}


@pytest.mark.parametrize("cls_name", ["ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 6), (4, 8)])
def test_torch_written_csv_loads_and_validates(tmp_path: Path, cls_name: str, p: int,
                                               m: int) -> None:
    cls = getattr(torch_schedules, cls_name)
    writer = object.__new__(cls)
    writer.pipeline_order = _torch_interleaved(cls, p, m, 2)
    path = tmp_path / "torch.csv"
    torch_schedules.PipelineScheduleMulti._dump_csv(writer, str(path))  # torch's own writer
    ours = schedules.validate(schedules.load_csv(path))
    assert (ours.num_ranks, ours.num_stages, ours.num_microbatches) == (p, 2 * p, m)
    if cls_name == "ScheduleInterleaved1F1B":
        # Same depth-first order as our generator once torch's idle cells are dropped.
        assert ours.actions == schedules.get_schedule("interleaved", p, m,
                                                      stages_per_rank=2).actions


def _torch_loader(path: Path, s: Schedule) -> Any:
    runtime = object.__new__(torch_schedules._PipelineScheduleRuntime)
    runtime.pp_group_size, runtime._num_stages = s.num_ranks, s.num_stages
    runtime._n_microbatches, runtime._stages, runtime.pipeline_order = s.num_microbatches, [], {}
    runtime._defer_pp_recv = False
    fmt = "compute_comms" if s.has_comms else "compute_only"
    torch_schedules._PipelineScheduleRuntime._load_csv(runtime, str(path), format=fmt)
    return runtime


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
@pytest.mark.parametrize("lowered", [False, True])
def test_torch_loads_ours(tmp_path: Path, name: str, lowered: bool) -> None:
    s = schedules.get_schedule(name, 2, 4)
    s = schedules.lower(s) if lowered else s
    path = tmp_path / "ours.csv"
    schedules.dump_csv(s, path)
    runtime = _torch_loader(path, s)
    with open(path, newline="") as f:
        cells = [c for row in csv.reader(f) for c in row]
    loaded = [str(a) for rank in sorted(runtime.pipeline_order_with_comms)
              for a in runtime.pipeline_order_with_comms[rank]]
    if lowered:
        assert loaded == cells
    else:  # torch lowers it itself (adding comms, unshard/reshard): our compute, in our order
        assert [c for c in loaded if re.fullmatch(r"\d+[FBIW]\d+", c)] == cells
