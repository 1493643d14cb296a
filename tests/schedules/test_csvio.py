import csv
import io
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given

import schedules
from schedules import Action, Op, Schedule, ScheduleError
from schedules.csvio import torch_incompatibility
from tests.strategies import schedules_any

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
from tests.torch_csv import TORCH_CLASSES, build, rank_stages, torch_csv, unsupported  # noqa: E402


@given(schedules_any())
def test_csv_round_trips(schedule: Schedule) -> None:
    dialects = ["ours"] + (["torch"] if torch_incompatibility(schedule) is None else [])
    for s in (schedule, schedules.lower(schedule)):
        for dialect in dialects:
            text = schedules.dumps_csv(s, dialect=dialect)
            # On one rank the loop and v placements are the same; the CSV cannot tell them apart.
            back = schedules.loads_csv(text, num_microbatches=s.num_microbatches, name=s.name,
                                       placement=s.placement if s.num_ranks == 1 else None)
            assert back == s, dialect


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


def test_an_action_on_the_wrong_row_is_named_with_its_row_and_a_fix() -> None:
    """Was: "no placement puts every stage on the rank of its row", naming no action."""
    # Stage 1 on rows 0 and 1: the second is named, with the row that holds stage 1 first.
    with pytest.raises(ScheduleError, match=r"row 1 \(rank 1\), column 1: '1B0' puts stage 1 "
                                            r"on rank 1, but row 0 \(column 1: '1F0'\) puts it "
                                            r"on rank 0.*move '1B0' to row 0"):
        schedules.loads_csv("0F0,1F0,0B0\n,1B0\n")
    # Each stage on one row, but in an order no placement has: stage 0 on rank 1.
    with pytest.raises(ScheduleError, match=r"row 0 \(rank 0\), column 0: '1F0' puts stage 1 on "
                                            r"rank 0, but placement 'loop' puts it on rank 1 "
                                            r"and 'v' on rank 1"):
        schedules.loads_csv("1F0,1B0\n0F0,0B0\n")


def _torch_cells(text: str) -> list[list[str]]:
    return [row for row in csv.reader(io.StringIO(text)) if row]


def test_torch_only_cells_are_dropped_and_overlaps_expanded() -> None:
    text = ("0UNSHARD,0F0,0SEND_F0,(0F1;0B0)OVERLAP_F_B,0RECV_B1,0B1,0REDUCE_GRAD,0RESHARD\n"
            "1UNSHARD,1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1,1REDUCE_GRAD\n")
    s = schedules.loads_csv(text)
    assert [str(a) for a in s.actions[0]] == ["0F0", "0SEND_F0", "0F1", "0B0", "0RECV_B1",
                                              "0B1"]
    assert [str(a) for a in s.actions[1]][-1] == "1SEND_B1"
    with pytest.raises(ScheduleError, match="column 1: cannot parse action '\\(0F1'"):
        schedules.loads_csv("0F0,((0F1;0B0)OVERLAP_F_B)OVERLAP_F_B\n")


# The classes whose order torch lowers to one with communication.
_RUNTIME_CLASSES = [c for c in TORCH_CLASSES
                    if isinstance(build(c, 2, 4), torch_schedules._PipelineScheduleRuntime)]


def _torch_grid() -> list[tuple[str, int, int]]:
    return [(c, p, m) for c in TORCH_CLASSES for p in range(1, 5) for m in range(1, 9)
            if unsupported(c, p, m) is None]


@pytest.mark.parametrize(("cls", "p", "m"), _torch_grid())
def test_every_torch_csv_loads_and_validates(cls: str, p: int, m: int) -> None:
    """Compute-only and with-communication CSVs of every torch class: read, and valid exactly
    when torch's own validator says so (its 1F1B order is not: torch runs 1F1B from a loop of
    its own, and in the order it writes the last rank's forwards are shifted by one)."""
    compute = schedules.loads_csv(torch_csv(cls, p, m, comms=False), num_microbatches=m)
    rows = {r: [torch_schedules._Action.from_str(c) for c in row]
            for r, row in enumerate(_torch_cells(torch_csv(cls, p, m, comms=False)))}
    try:
        torch_schedules._validate_schedule(rows, p, compute.num_stages, m)
    except AssertionError as exc:
        assert cls == "Schedule1F1B", exc
        with pytest.raises(ScheduleError):
            schedules.validate(compute)
        return
    schedules.validate(compute)
    stages = {a.stage for row in compute.actions for a in row}
    assert (compute.num_ranks, compute.num_microbatches, len(stages)) == (
        p, m, p * len(rank_stages(cls, p, 0)))
    if cls in _RUNTIME_CLASSES:
        lowered = schedules.validate(schedules.loads_csv(torch_csv(cls, p, m, comms=True),
                                                         num_microbatches=m))
        assert lowered.has_comms or p == 1
        assert lowered.compute_only() == compute  # same compute, in the same order


@pytest.mark.parametrize("cls", ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                                 "ScheduleInterleavedZeroBubble"])
def test_torch_multi_stage_classes_with_one_stage_per_rank(cls: str) -> None:
    """As the benchmarks run torch's zero-bubble peer of zb-h1: one stage per rank, both forms
    read, valid, and the same compute (ZB1P at one stage per rank is the paper's ZB-H1)."""
    for p, m in [(1, 3), (2, 2), (2, 6), (3, 4), (4, 8)]:
        compute = schedules.validate(schedules.loads_csv(
            torch_csv(cls, p, m, comms=False, stages_per_rank=1), num_microbatches=m))
        lowered = schedules.validate(schedules.loads_csv(
            torch_csv(cls, p, m, comms=True, stages_per_rank=1), num_microbatches=m))
        assert compute.num_stages == p and lowered.compute_only() == compute


def test_torch_interleaved_is_ours_once_idle_cells_are_dropped() -> None:
    for p, m in [(2, 4), (2, 6), (4, 8)]:
        ours = schedules.get_schedule("interleaved", p, m, stages_per_rank=2)
        theirs = schedules.loads_csv(torch_csv("ScheduleInterleaved1F1B", p, m, comms=False))
        assert theirs.actions == ours.actions


def _torch_loader(path: Path, s: Schedule) -> Any:
    runtime = object.__new__(torch_schedules._PipelineScheduleRuntime)
    runtime.pp_group_size, runtime._num_stages = s.num_ranks, s.num_stages
    runtime._n_microbatches, runtime._stages, runtime.pipeline_order = s.num_microbatches, [], {}
    runtime._defer_pp_recv = False
    fmt = "compute_comms" if s.has_comms else "compute_only"
    torch_schedules._PipelineScheduleRuntime._load_csv(runtime, str(path), format=fmt)
    return runtime


def _torch_compatible() -> list[tuple[str, int, int]]:
    """(generator, p, m) for every registered generator whose schedules torch can run."""
    out = []
    for name in schedules.available():
        gen = schedules.info(name)
        for p, m in [(1, 3), (2, 1), (2, 5), (3, 4), (4, 8)]:
            s = schedules.get_schedule(name, p, m,
                                       **gen.options_for(stages_per_rank=gen.stages_per_rank))
            if torch_incompatibility(s) is None:
                out.append((name, p, m))
    return out


@pytest.mark.parametrize(("name", "p", "m"), _torch_compatible())
def test_torch_reads_our_dialect_as_written(tmp_path: Path, name: str, p: int, m: int) -> None:
    """Torch loads what we write, cell for cell; lowered, each stage's REDUCE_GRAD sits where
    torch's own lowering (`_add_reduce_grad`) puts it: after the stage's m-th backward."""
    gen = schedules.info(name)
    compute = schedules.get_schedule(name, p, m,
                                     **gen.options_for(stages_per_rank=gen.stages_per_rank))
    for s in (compute, schedules.lower(compute)):
        path = tmp_path / "ours.csv"
        schedules.dump_csv(s, path)
        cells = _torch_cells(path.read_text())
        runtime = _torch_loader(path, s)
        loaded = [[str(a) for a in runtime.pipeline_order_with_comms[r]] for r in range(p)]
        if s.has_comms:
            assert loaded == cells
            for r, row in enumerate(compute.actions):
                actions = [torch_schedules._Action.from_str(str(a)) for a in row]
                expected = [str(a) for a in torch_schedules._add_reduce_grad(actions, m)]
                assert [c for c in cells[r] if "SEND" not in c and "RECV" not in c] == expected
        else:  # torch lowers it itself: our compute, in our order
            assert cells == [[str(a) for a in row] for row in s.actions]
            assert [[c for c in row if torch_schedules._Action.from_str(c).is_compute_op]
                    for row in loaded] == cells


def test_torch_dialect_refuses_what_torch_cannot_run() -> None:
    two_bw = schedules.get_schedule("2bw", 2, 2, num_batches=2)
    with pytest.raises(ScheduleError, match=r"no update action.*dialect='ours'"):
        schedules.dumps_csv(two_bw)
    assert "1U1" in schedules.dumps_csv(two_bw, dialect="ours")
    versioned = Schedule(1, 1, 1, ((Action(0, Op.F, 0, 1), Action(0, Op.B, 0, 1)),))
    with pytest.raises(ScheduleError, match=r"weight versions \(e.g. 0F0v1\).*read 0F0v1 as 0F0"):
        schedules.dumps_csv(versioned)
    with pytest.raises(ScheduleError, match="dialect must be one of"):
        schedules.dumps_csv(versioned, dialect="megatron")


@pytest.mark.timeout(10)
def test_an_out_of_range_stage_or_micro_batch_is_refused_quickly() -> None:
    """A stage of 10**9 once built a placement table of 10**9 entries (a hang): an index needs
    an action per stage (or micro-batch) below it, so it stays below the number of actions."""
    with pytest.raises(ScheduleError, match=r"row 1 \(rank 1\), column 1: stage 1000000000 in "
                                            r"'1000000000F0' is out of range.*0 to 2"):
        schedules.loads_csv("0F0\n1F0,1000000000F0\n")
    with pytest.raises(ScheduleError, match=r"column 0: micro-batch 99 in '0F99' is out of "
                                            r"range.*0 to 1"):
        schedules.loads_csv("0F99,0B0\n")


def test_a_binary_file_is_not_a_text_csv(tmp_path: Path) -> None:
    """It once raised a bare UnicodeDecodeError."""
    path = tmp_path / "schedule.csv"
    path.write_bytes(b"0F0,\xff\xfe\x00\x81\n")
    with pytest.raises(ScheduleError, match=r"schedule\.csv is not a text CSV: byte 4 .*UTF-8"):
        schedules.load_csv(path)


def test_a_number_of_thousands_of_digits_names_its_cell() -> None:
    """It once raised Python's 'Exceeds the limit (4300 digits) for integer string conversion'."""
    with pytest.raises(ScheduleError, match=r"row 0 \(rank 0\), column 1: .*at most 18 digits "
                                            r"\(got 5000 in '0F99999"):
        schedules.loads_csv("0F0,0F" + "9" * 5000 + "\n")
    with pytest.raises(ScheduleError, match=r"cannot read the CSV: field larger than field limit"):
        schedules.loads_csv("0F0," + "0" * 200_000 + "\n")
