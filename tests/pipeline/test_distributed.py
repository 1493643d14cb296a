"""Multi-process pipelines: 2 to 4 gloo ranks on loopback, against the single-device model."""

from __future__ import annotations

import pytest
import torch

import schedules
from pipeline.launch import RankFailed, spawn
from tests.limits import DIST_TEST_TIMEOUT, IN_TURN_TEST_TIMEOUT, SPAWN_TIMEOUT
from tests.pipeline import dist_workers
from tests.pipeline.in_turn import InTurn, in_turn, ranks

pytestmark = pytest.mark.dist

SCHEDULES = schedules.available()
MODES = ("never", "except_last", "always")


def _balances(per_rank_layers: list[int]) -> dict[str, list[int]]:
    """Per schedule, `per_rank_layers` split evenly over the stages each rank holds."""
    out = {}
    for s in SCHEDULES:
        k = schedules.info(s).stages_per_rank
        out[s] = [n // k + (i < n % k) for n in per_rank_layers for i in range(k)]
    return out


EVERY_COMBO = [(s, c) for s in SCHEDULES for c in MODES]
THREE_COMBOS = [(s, "except_last") for s in SCHEDULES]
FOUR_COMBOS = [("1f1b", "always"), ("zb-h1", "never"), ("interleaved", "never"),
               ("zb-v", "always"), ("dualpipe-v", "never")]
SUBGROUPS = {"01-23": [[0, 1], [2, 3]], "02-13": [[0, 2], [1, 3]]}
# What two ranks disagree on, and how the refusal names each rank's value.
DISAGREEING = {"balance": "rank 0: [2, 6]; rank 1: [6, 2]",
               "schedule": 'rank 0: "gpipe"; rank 1: "1f1b"',
               "batch rows": "rank 0: [8]; rank 1: [6]"}

# The scenarios that train without failing (and leave the process as they found it), on one
# set of ranks per size in turn (see tests/pipeline/in_turn.py); each test checks its own.
TWO_RANKS = [
    ("every combo", dist_workers.equivalence, (EVERY_COMBO, _balances([4, 4]))),
    ("integer inputs", dist_workers.integer_inputs, ()),
    ("auto synthesised", dist_workers.synthesised, ()),
    ("one-tuples", dist_workers.structure_and_input_grads, ()),
    *[(f"resume {s}", dist_workers.resume, (s,)) for s in ("1f1b", "2bw")],
    *[(f"batch norm, deferred={d}", dist_workers.batch_norm_statistics, (d,))
      for d in (False, True)],
    *[(f"released {s}", dist_workers.released_outputs, (s,)) for s in ("1f1b", "zb-h1")],
    # Last: refusals before any work, after which the ranks go on, and profilers replaced.
    *[(f"disagree on {f}", dist_workers.disagreeing_ranks, (f,)) for f in DISAGREEING],
    *[(f"profiled by {m}", dist_workers.profiled_balance, (m,)) for m in ("time", "size")],
]
THREE_RANKS = [
    ("every schedule", dist_workers.equivalence, (THREE_COMBOS, _balances([2, 3, 3]))),
    ("2bw many", dist_workers.two_bw_many, ()),
    ("meta", dist_workers.meta_and_checkpoint, ()),
    ("linked", dist_workers.linked_peers, ()),  # links on, as by default
]
FOUR_RANKS = [
    ("five schedules", dist_workers.equivalence, (FOUR_COMBOS, _balances([2, 2, 2, 2]))),
    *[(name, dist_workers.subgroup_pipelines, (members,)) for name, members in SUBGROUPS.items()],
]


two_ranks = ranks("two_ranks", 2, TWO_RANKS)
three_ranks = ranks("three_ranks", 3, THREE_RANKS)
four_ranks = ranks("four_ranks", 4, FOUR_RANKS)


@in_turn
def test_two_ranks_every_schedule_and_mode(two_ranks: InTurn) -> None:
    assert two_ranks("every combo") == [2 * len(EVERY_COMBO)] * 2


def test_auto_synthesised_on_each_rank_trains_exactly(two_ranks: InTurn) -> None:
    # Unequal stages: the heuristic's own order (8% faster than zb-h1 in simulation), built
    # by each process from the same costs, trains exactly (checked on each rank).
    from schedules.auto import search

    costs = schedules.Costs(forward=[1, 1], backward_input=[1, 3], backward_weight=[3, 1],
                            backward=[4, 4], comm=0.5)
    here = search(2, 4, costs, memory_limit=3)
    assert here.chosen == "greedy(caps=3/3, fill=idle)"
    assert here.makespan == 23.0 and here.best_fixed == ("zb-h1", 25.0)
    rows = [[str(a) for a in row] for row in here.schedule.actions]
    assert two_ranks("auto synthesised") == [(here.chosen, rows[0]), (here.chosen, rows[1])]


@pytest.mark.timeout(2 * IN_TURN_TEST_TIMEOUT)  # may start both sets of ranks
def test_three_and_four_ranks(three_ranks: InTurn, four_ranks: InTurn) -> None:
    assert three_ranks("every schedule") == [2 * len(THREE_COMBOS)] * 3
    assert four_ranks("five schedules") == [10] * 4


# The linked run among the others in turn, then two spawns of its own.
@pytest.mark.timeout(IN_TURN_TEST_TIMEOUT + 2 * DIST_TEST_TIMEOUT)
def test_ranks_on_one_host_link_and_the_backend_path_still_trains(
        monkeypatch: pytest.MonkeyPatch, three_ranks: InTurn) -> None:
    assert three_ranks("linked") == [[1, 2], [0, 2], [0, 1]]
    monkeypatch.setenv("PIPELINE_LOCAL_P2P", "0")  # the spawned ranks inherit it
    assert spawn(dist_workers.linked_peers, 3, timeout=SPAWN_TIMEOUT) == [[]] * 3
    combos = [("1f1b", "never"), ("zb-h1", "always"), ("interleaved", "except_last")]
    # Four batch sizes: shapes change back and forth while gloo has later receives posted.
    assert spawn(dist_workers.equivalence, 2, combos, _balances([4, 4]), (10, 7, 10, 12),
                 timeout=SPAWN_TIMEOUT) == [4 * len(combos)] * 2


@in_turn
def test_integer_inputs(two_ranks: InTurn) -> None:
    losses = two_ranks("integer inputs")
    assert losses[0] == losses[1]  # every rank returns the loss


@in_turn
def test_2bw_many_batches_across_processes(three_ranks: InTurn) -> None:
    results = three_ranks("2bw many")
    assert results[0] == results[1] == results[2]


@in_turn
def test_meta_device_and_full_checkpoint(three_ranks: InTurn) -> None:
    keys = three_ranks("meta")
    # Balance [3, 2, 3]: each rank holds (and keys) only its layers, named as in the model.
    assert keys == [["0.bias", "0.weight", "2.bias", "2.weight"], ["4.bias", "4.weight"],
                    ["5.bias", "5.weight", "7.bias", "7.weight"]]


# The failure tests run Pipe(timeout=FAILURE_TIMEOUT): an error that only the timeout ended
# would take that long, so a step that fails within a third of it was stopped by the failure
# (a loaded machine needs a few seconds, not minutes). The others get a long `grace` to report:
# it is waited for only when one of them does not.
FOUND_WELL_BEFORE_THE_TIMEOUT = dist_workers.FAILURE_TIMEOUT / 3
GRACE = 60.0


def test_exception_in_a_middle_rank_reaches_every_rank() -> None:
    results = spawn(dist_workers.failing_middle, 3, "raise", timeout=SPAWN_TIMEOUT)
    for rank, (message, seconds) in enumerate(results):
        assert "rank 1 (cpu) failed at 1F3 (forward of stage 1, micro-batch 3)" in message, rank
        assert "ValueError: bad micro-batch" in message
        assert seconds < FOUND_WELL_BEFORE_THE_TIMEOUT, (rank, seconds)


def test_killed_rank_is_named_by_the_others() -> None:
    with pytest.raises(RankFailed) as err:
        spawn(dist_workers.failing_middle, 3, "kill", timeout=SPAWN_TIMEOUT, grace=GRACE)
    assert "rank 1: process died" in str(err.value)
    survivors = err.value.results
    assert sorted(survivors) == [0, 2]
    for rank, (message, seconds) in survivors.items():
        assert "rank 1" in message, (rank, message)
        assert seconds < FOUND_WELL_BEFORE_THE_TIMEOUT, (rank, seconds)


@pytest.mark.parametrize("links", ["1", "0"])
def test_one_message_per_transfer_once_shapes_are_agreed(
        links: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Over a link: one sendmsg carries the flag and every tensor. Over gloo: one buffer.
    monkeypatch.setenv("PIPELINE_LOCAL_P2P", links)  # the spawned ranks inherit it
    for calls, expected in spawn(dist_workers.one_message_per_transfer, 2,
                                 timeout=SPAWN_TIMEOUT):
        assert calls == expected


@in_turn
@pytest.mark.parametrize("subgroups", list(SUBGROUPS))
def test_pipelines_on_subgroups_address_global_ranks(subgroups: str, four_ranks: InTurn) -> None:
    losses = four_ranks(subgroups)
    for group in SUBGROUPS[subgroups]:  # both ranks of a pipeline return its loss
        assert losses[group[0]] == losses[group[1]]


@in_turn
def test_one_tuples_and_input_gradients_across_processes(two_ranks: InTurn) -> None:
    assert two_ranks("one-tuples") == [True, True]


@in_turn
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_resume_across_processes_is_bit_identical(schedule: str, two_ranks: InTurn) -> None:
    assert two_ranks(f"resume {schedule}") == [True, True]


@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_rank_that_died_between_steps_is_named(steps_before: int) -> None:
    with pytest.raises(RankFailed) as err:
        spawn(dist_workers.dies_between_steps, 3, steps_before, timeout=SPAWN_TIMEOUT,
              grace=GRACE)
    survivors = err.value.results
    assert sorted(survivors) == [0, 2]
    for rank, (message, seconds) in survivors.items():
        assert message.startswith("PipelineError: "), (rank, message)
        assert "rank 1 is gone" in message, (rank, message)
        assert seconds < FOUND_WELL_BEFORE_THE_TIMEOUT, (rank, seconds)


def test_the_first_failure_is_named_even_after_rank_0_exits() -> None:
    with pytest.raises(RankFailed) as err:
        spawn(dist_workers.first_failure_after_rank0_exits, 3, timeout=SPAWN_TIMEOUT,
              grace=GRACE)
    survivors = err.value.results
    assert sorted(survivors) == [1, 2]
    for rank, message in survivors.items():
        assert "rank 2 (cpu) failed at 2F" in message and "bad micro-batch" in message, (
            rank, message)


@pytest.mark.parametrize("links", ["1", "0"])
def test_every_call_after_a_failure_says_the_group_is_unusable(
        links: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: over gloo the next step's tie sync read an activation of the failed step
    # ("AssertionError: rank 1: expected (13, 16) torch.float32 from rank 0, got ...").
    monkeypatch.setenv("PIPELINE_LOCAL_P2P", links)  # the spawned ranks inherit it
    for rank, seen in enumerate(spawn(dist_workers.unusable_after_failure, 2,
                                      timeout=SPAWN_TIMEOUT)):
        assert len(seen) == 4, (rank, seen)
        for message in seen:
            assert message.startswith(f"PipelineError: rank {rank}: this pipeline's process "
                                      "group is unusable after an earlier failure ("), message
            assert "bad loss" in message or "rank 1" in message, message


@in_turn
@pytest.mark.parametrize("field", list(DISAGREEING))
def test_ranks_that_disagree_raise_pipe_config_error(field: str, two_ranks: InTurn) -> None:
    # Before: different balances trained with a layer never run, different schedules
    # deadlocked until the timeout, different batch sizes trained on a broadcast loss.
    values = DISAGREEING[field]
    for message in two_ranks(f"disagree on {field}"):
        assert message.startswith(f"PipeConfigError: ranks disagree on {field} ({values})"), (
            message)


@in_turn
@pytest.mark.parametrize("method", ["time", "size"])
def test_profiled_balance_is_rank_0s_on_every_rank(method: str, two_ranks: InTurn) -> None:
    # Rank 0's costs put 7 cheap layers first ([7, 1]); rank 1's would give [1, 7].
    assert two_ranks(f"profiled by {method}") == [[7, 1], [7, 1]]


def test_a_last_stage_target_with_other_rows_fails_every_rank() -> None:
    # Before: the last rank trained silently on a loss broadcast from 4 output rows to 3.
    messages = spawn(dist_workers.target_rows_differ_later, 2, timeout=SPAWN_TIMEOUT)
    assert all("rank 1" in m and "micro-batch 0: its target has 3 rows but its input had 4" in m
               for m in messages), messages


@in_turn
@pytest.mark.parametrize("deferred", [False, True])
def test_batch_norm_statistics_across_processes(deferred: bool, two_ranks: InTurn) -> None:
    # Rank 0 holds two BatchNorm layers, rank 1 one: three buffers each.
    assert two_ranks(f"batch norm, deferred={deferred}") == [6, 3]


@in_turn
@pytest.mark.parametrize(("schedule", "last_held"), [("1f1b", 48), ("zb-h1", 96)])
def test_sent_activations_are_released_and_gradients_stay_exact(schedule: str, last_held: int,
                                                                 two_ranks: InTurn) -> None:
    # Rank 0 sends two micro-batches of 4 x 16 fp32 (a Linear's output): 512 bytes freed, so
    # at its peak it holds one output (256 bytes, before its SEND) beyond the stash. Rank 1
    # holds its last Linear's 4 x 3 outputs (48 bytes each) until their stash is freed: one
    # at a time under 1F1B, both under ZB-H1 (its W's come after both I's).
    assert two_ranks(f"released {schedule}") == [(512, 256), (0, last_held)]


def test_without_release_a_rank_holds_every_output_until_its_backward() -> None:
    # Threads share memory (nothing is copied, so nothing can be released): under 1F1B with
    # m = 2 rank 0 runs both forwards before a backward and holds both outputs at its peak.
    from torch import nn

    from pipeline import Pipe

    pipe = Pipe(dist_workers._model(), [3, 5], chunks=2, devices=["cpu", "cpu"],
                checkpoint="never")
    pipe.track_memory = True
    pipe.step(torch.randn(8, 6), torch.randn(8, 3), nn.MSELoss())
    stats = pipe.memory_stats()
    assert [s["released_output_bytes"] for s in stats] == [0, 0]
    assert [s["peak_activation_bytes"] - s["peak_stashed_bytes"] for s in stats] == [512, 48]
