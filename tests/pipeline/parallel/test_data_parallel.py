"""Pipeline x data parallelism on a DeviceMesh ("dp" x "pp"), over gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline import Pipe, PipeConfigError
from pipeline.launch import RankFailed, spawn
from pipeline.parallel.data_parallel import _chunks, _union
from tests.limits import DIST_TEST_TIMEOUT, IN_TURN_TEST_TIMEOUT, IN_TURN_TIMEOUT, SPAWN_TIMEOUT
from tests.pipeline import dp_workers, replica_workers
from tests.pipeline.in_turn import InTurn, in_turn

pytestmark = [pytest.mark.dist, pytest.mark.slow]

COMBOS_2x2 = [("gpipe", "never", [4, 4]), ("1f1b", "always", [4, 4]),
              ("interleaved", "never", [2, 2, 2, 2]), ("zb-h1", "always", [4, 4])]

# The scenarios that train without failing, on one set of 4 ranks in turn (see
# tests/pipeline/in_turn.py); each test below checks its own. The fixture adds the first
# mesh of the checkpoint's moves, which saves to a directory of its own.
FOUR_RANKS = [
    # Losses reducing by mean and by sum.
    ("2x2", dp_workers.equivalence, (2, 2, COMBOS_2x2, ("mean", "sum"))),
    ("4x1", dp_workers.equivalence, (4, 1, [("1f1b", "always", [8])])),
    ("1x4", dp_workers.equivalence, (1, 4, [("1f1b", "never", [2, 2, 2, 2]),
                                            ("zb-h1", "always", [2, 2, 2, 2])])),
    ("stats", dp_workers.stats, ()),
    ("zero", dp_workers.zero_one, ()),
    ("fsdp", dp_workers.fsdp, ([("1f1b", "never"), ("gpipe", "always")],)),
    ("unused", replica_workers.unused_parameters, ()),
    ("batch norm", replica_workers.batch_norm, ()),
    ("ties", replica_workers.ties_and_clipping, ()),
    ("zb-v and 2bw", replica_workers.zero_bubble_v_and_2bw, ()),
]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp")


@pytest.fixture(scope="module")
def four_ranks(checkpoint_dir: Path) -> InTurn:
    return InTurn(4, [*FOUR_RANKS, ("checkpoint at 2x2", dp_workers.checkpoint_moves,
                                    (2, 2, str(checkpoint_dir), True))],
                  timeout=IN_TURN_TIMEOUT)


@in_turn
def test_2x2_equals_one_device_on_the_global_batch(four_ranks: InTurn) -> None:
    assert four_ranks("2x2") == [8] * 4


@in_turn
def test_4x1_and_1x4_equal_one_device(four_ranks: InTurn) -> None:
    assert four_ranks("4x1") == [1] * 4
    assert four_ranks("1x4") == [2] * 4


@in_turn
def test_the_pipe_reports_the_hidden_share_of_the_all_reduce(four_ranks: InTurn) -> None:
    for stats in four_ranks("stats"):
        assert stats["allreduce_s"] > 0 and 0.0 <= stats["hidden_share"] <= 1.0
        assert stats["exposed_s"] <= stats["allreduce_s"] + 1e-9


@in_turn
def test_zero_redundancy_optimizer_over_dp_equals_plain_adam(four_ranks: InTurn) -> None:
    assert four_ranks("zero") == [True] * 4


def test_a_killed_rank_is_named_with_its_coordinates_on_every_rank() -> None:
    with pytest.raises(RankFailed) as info:
        spawn(dp_workers.killed_mid_step, 4, timeout=SPAWN_TIMEOUT, grace=60)
    results = info.value.results
    assert sorted(results) == [0, 1, 2], str(info.value)  # rank 3 died
    for rank, message in results.items():
        assert "rank 3" in message or "global rank 3" in message, (rank, message)
        assert "dp 1, pp 1" in message, (rank, message)
        assert float(message.split("s:")[0]) < 30, (rank, message)


def test_replicas_that_disagree_raise_pipe_config_error() -> None:
    for message in spawn(dp_workers.disagreeing_replicas, 2, timeout=SPAWN_TIMEOUT):
        assert message.startswith("PipeConfigError: the replicas"), message
        assert '"chunks": 2' in message and '"chunks": 4' in message


# -- pieces, in one process
@pytest.mark.parametrize("mesh", [object(), "dp"])
def test_a_mesh_that_is_not_a_named_device_mesh_is_refused(mesh: object) -> None:
    with pytest.raises(PipeConfigError, match="DeviceMesh with named dimensions"):
        Pipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), [1], mesh=mesh)


def test_buckets_and_time_unions() -> None:
    big = [torch.nn.Parameter(torch.zeros(2**21)) for _ in range(5)]  # 8 MiB each
    assert [len(c) for c in _chunks(big)] == [3, 2]
    assert _union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)


# The 2x2 mesh's step and save among the other scenarios in turn, then a spawn of its own.
@pytest.mark.timeout(IN_TURN_TEST_TIMEOUT + DIST_TEST_TIMEOUT)
def test_a_checkpoint_moves_between_2x2_1x2_and_one_device(
        four_ranks: InTurn, checkpoint_dir: Path) -> None:
    path = str(checkpoint_dir)
    assert four_ranks("checkpoint at 2x2") == [True] * 4
    # 2x2 -> 1x2: the full state_dict, and the sharded checkpoint with Adam's state.
    assert spawn(dp_workers.checkpoint_moves, 2, 1, 2, path, False,
                 timeout=SPAWN_TIMEOUT) == [True] * 2
    # ... and into one device, from the sharded checkpoint.
    from pipeline.state import sharded

    model = dp_workers._model(seed=9)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    sharded.load(model, f"{path}/sharded", optimizer)
    full = torch.load(f"{path}/full.pt")
    for key, value in model.state_dict().items():
        assert torch.equal(value, full[key]), key


@in_turn
def test_fsdp2_over_dp_equals_one_device(four_ranks: InTurn) -> None:
    assert four_ranks("fsdp") == [2] * 4


def test_fsdp_without_a_dp_dimension_is_refused() -> None:
    with pytest.raises(PipeConfigError, match="shards over a mesh's 'dp' dimension"):
        Pipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), [1], data_parallel="fsdp")
    with pytest.raises(PipeConfigError, match="data_parallel must be one of"):
        Pipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), [1], data_parallel="zero3")


# -- replicas that agree with one device and with DDP (tests/pipeline/replica_workers.py)
@in_turn
def test_a_parameter_no_replica_used_keeps_no_gradient_and_adamw_equals_one_device(
        four_ranks: InTurn) -> None:
    assert four_ranks("unused") == [15, 18, 15, 18]


@in_turn
def test_batch_norm_buffers_agree_across_replicas_and_with_one_device(
        four_ranks: InTurn) -> None:
    # Stage 0 holds two BatchNorm layers (six buffers), stage 1 one (three); 4 modes x 2 steps.
    assert four_ranks("batch norm") == [48, 24, 48, 24]


@in_turn
def test_ties_with_accumulating_steps_and_clipping_under_dp_equal_one_device(
        four_ranks: InTurn) -> None:
    assert four_ranks("ties") == [True] * 4


@in_turn
def test_zero_bubble_v_and_2bw_under_dp_equal_one_device(four_ranks: InTurn) -> None:
    assert four_ranks("zb-v and 2bw") == [3] * 4
