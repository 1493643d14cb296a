"""Tensor parallelism in the planner: what a tp plan splits, a profile per tp rank, the
dp x pp x tp search and the Pipe arguments of a tp plan."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from pipeline.errors import PipeConfigError
from pipeline.examples.models import get_model
from pipeline.planner import (
    Link,
    ModelProfile,
    Plan,
    PlanError,
    TensorSharding,
    plan,
    plan_profile,
    predict,
    sharding_of,
)
from pipeline.planner.costs import parameter_keys
from pipeline.planner.tensor import REPLICATED_ACTIVATIONS, shard_profile
from pipeline.planner.ties import NEAR
from tests.strategies import full_sharding, sharded_profiles, synthetic_profile

_HOST = Link("gloo", 1e-5, 1e-9)  # the link of tp's all-reduces in these tests
_TP_PLAN = {"*.qkv": ColwiseParallel(), "*.proj": RowwiseParallel(),
            "*.up": ColwiseParallel(), "*.down": RowwiseParallel()}


def test_a_torch_plan_splits_what_its_styles_split() -> None:
    model = get_model("transformer").build()  # embedding, (attention, MLP) x 4, head
    sharding = sharding_of(model, _TP_PLAN)
    covered = [i for i, t in enumerate(sharding.split_time) if t]
    assert covered == list(range(1, 9))  # the attention and MLP layers, not the ends
    # One row-parallel module per layer: one all-reduce of its output forward, one of the
    # input gradient backward (Megatron's f and g).
    assert sharding.forward_collectives == (0, *[1] * 8, 0)
    assert sharding.backward_collectives == (0, *[1] * 8, 0)
    assert sharding.split_saved[1] == pytest.approx(1 - REPLICATED_ACTIVATIONS)
    assert not sharding.sequence_parallel
    # Split: the column-parallel weights and biases, the row-parallel weights; a row-parallel
    # bias and every layer norm stay whole.
    keys = parameter_keys(model)
    attention = model[1]
    assert keys[id(attention.qkv.weight)] in sharding.split_params
    assert keys[id(attention.qkv.bias)] in sharding.split_params
    assert keys[id(attention.proj.weight)] in sharding.split_params
    assert keys[id(attention.proj.bias)] not in sharding.split_params
    assert keys[id(attention.norm.weight)] not in sharding.split_params


def test_patterns_name_modules_in_the_model_or_within_a_layer() -> None:
    model = get_model("transformer").build()
    only_first = sharding_of(model, {"1.qkv": ColwiseParallel(), "proj": "rowwise"})
    assert only_first.split_time == (0, 1, 0, 1, 0, 1, 0, 1, 0, 0)
    assert only_first.backward_collectives[1] == 1 and only_first.forward_collectives[3] == 1
    # Sequence parallelism splits the activations left whole otherwise.
    sequence = sharding_of(model, {**_TP_PLAN, "*.norm": SequenceParallel()})
    assert sequence.sequence_parallel and sequence.split_saved[1] == 1.0


@pytest.mark.parametrize("tp_plan, message", [
    ({"*.nothing": ColwiseParallel()}, "match no module"),
    ({"*.qkv": "diagonal"}, "not one the planner knows"),
    ({}, "non-empty dict"),
    ({"*.norm": SequenceParallel()}, "splits no layer"),
])
def test_a_plan_that_cannot_apply_says_why(tp_plan: dict[str, Any], message: str) -> None:
    with pytest.raises(PipeConfigError, match=message):
        sharding_of(get_model("transformer").build(), tp_plan)


def _two_layers() -> ModelProfile:
    # Per layer (seconds per row, saved bytes per row, parameter bytes); 4 rows, 1e-4 s of
    # overhead per pass: forwards 5e-4 and 9e-4 s, backwards twice that, I and W halves.
    return synthetic_profile([(1e-4, 1000.0, 4000.0), (2e-4, 500.0, 8000.0)], 4)


def _selective() -> TensorSharding:
    # Layer 0: half its time split, its parameters and activations whole, one all-reduce in
    # backward; layer 1: all split, two all-reduces each way.
    return TensorSharding(frozenset({1}), (0.5, 1.0), (0.0, 1.0), (0, 2), (1, 2))


def test_a_profile_per_tp_rank_matches_a_hand_count() -> None:
    profile, sharding = _two_layers(), _selective()
    got = shard_profile(profile, sharding, 2, _HOST).at(4)
    # A ring all-reduce of 16 bytes (a layer's input, 4 rows x 4 bytes) over 2 ranks:
    # 2 (t - 1) steps of 1e-5 s + 8 bytes x 1e-9 s.
    ar = 2 * (1e-5 + 8 * 1e-9)
    assert got.forward == pytest.approx((5e-4 * 0.75, 9e-4 / 2 + 2 * ar), rel=1e-12)
    assert got.backward == pytest.approx((1e-3 * 0.75 + ar, 1.8e-3 / 2 + 2 * ar), rel=1e-12)
    assert got.backward_input == pytest.approx((5e-4 * 0.75 + ar, 9e-4 / 2 + 2 * ar),
                                               rel=1e-12)
    assert got.backward_weight == pytest.approx((5e-4 * 0.75, 9e-4 / 2), rel=1e-12)
    assert got.saved_bytes == (4000.0, 1000.0) and got.input_bytes == (16.0, 16.0)
    sharded = shard_profile(profile, sharding, 2, _HOST)
    assert sharded.params == (((0, 4000, True),), ((1, 4000, True),))
    assert shard_profile(profile, sharding, 1, _HOST) is profile


def test_tp_cuts_memory_and_adds_its_collectives_as_modelled() -> None:
    profile, sharding = _two_layers(), _selective()

    def one_rank(tp: int) -> Any:
        return predict(profile, Link("gloo", 0.0, 0.0), schedule="gpipe", chunks=1,
                       checkpoint="never", pp=1, tp=tp, sharding=sharding, host_link=_HOST)

    whole, split = one_rank(1), one_rank(2)
    # Parameters, gradients and Adam's two states (4 bytes per parameter byte) and Adam's
    # step counter per tensor, plus the stage's input and both layers' saved tensors.
    assert whole.peak_bytes == (4 * 12000 + 2 * 4 + 16 + 6000,)
    assert split.peak_bytes == (4 * 8000 + 2 * 4 + 16 + 4000 + 1000,)
    # One rank runs everything: forward then backward, collectives included.
    ar = 2 * (1e-5 + 8 * 1e-9)
    assert whole.step_time == pytest.approx(3 * (5e-4 + 9e-4), rel=1e-12)
    assert split.step_time == pytest.approx(
        3 * (5e-4 * 0.75) + 3 * (9e-4 / 2) + ar + 4 * ar, rel=1e-12)


def test_sequence_parallelism_splits_the_inputs_between_stages() -> None:
    profile = _two_layers()
    sequence = TensorSharding(frozenset(), (1.0, 1.0), (1.0, 1.0), (1, 1), (1, 1), None, True)
    got = shard_profile(profile, sequence, 4, _HOST).at(4)
    assert got.input_bytes == (16.0, 4.0)  # the first layer's input is the batch itself


def test_pipeline_messages_take_the_link_between_hosts_when_the_pipeline_spans_hosts() -> None:
    profile = _two_layers()
    network, host = Link("nccl", 1e-3, 1e-6), Link("nccl", 1e-6, 1e-9)

    def step(ranks_per_host: int) -> float:
        got = predict(profile, network, schedule="gpipe", chunks=1, checkpoint="never",
                      pp=2, host_link=host, ranks_per_host=ranks_per_host)
        assert got.step_time is not None
        return got.step_time

    # One micro-batch crosses the stage boundary twice (activation, then its gradient); the
    # boundary is layer 1's input, 16 bytes.
    assert step(1) - step(2) == pytest.approx(2 * (network.time(16) - host.time(16)),
                                              rel=1e-9)


@settings(max_examples=15, deadline=None)
@given(sharded_profiles(), st.sampled_from([2, 4, 8]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1.0, 0.0]))
def test_the_3d_search_keeps_its_rules_and_is_never_slower_than_a_candidate(
        drawn: tuple[ModelProfile, TensorSharding], ranks: int, per_host: int,
        latency: float) -> None:
    profile, sharding = drawn
    if ranks > per_host and ranks % per_host:
        return
    link = Link("gloo", 1e-5 * latency, 1e-10)
    try:
        p = plan_profile(profile, ranks=ranks, memory_per_rank=None, link=link,
                         sharding=sharding, ranks_per_host=per_host, host_link=_HOST,
                         schedules=["1f1b", "gpipe", "zb-h1", "interleaved"],
                         max_stages_per_rank=2)
    except PlanError as exc:  # more stages than layers at every shape
        assert math.isinf(exc.minimum_bytes)
        return
    sizes = {t for t in range(1, per_host + 1) if per_host % t == 0 and ranks % t == 0}
    for c in p.candidates:
        assert c.dp * c.pp * c.tp == ranks
        assert per_host % c.tp == 0 and c.tp in sizes  # tp stays within a host
        assert profile.batch_rows % c.dp == 0
        if c.step_time is None:
            continue
        alone = predict(profile, link, schedule=c.schedule, chunks=c.chunks,
                        checkpoint=c.checkpoint, options=c.options, dp=c.dp, pp=c.pp,
                        tp=c.tp, sharding=sharding, host_link=_HOST, ranks_per_host=per_host)
        assert alone.step_time == pytest.approx(c.step_time, rel=1e-12)
        # The simplest of the near ties is chosen: within their margin of every candidate.
        assert p.predicted_step_time <= c.step_time * (1 + NEAR) * (1 + 1e-12)


def test_a_model_too_large_for_one_rank_is_planned_with_tp() -> None:
    # One layer of 1 MB of parameters: 4 MB with its gradient and Adam's state, more than a
    # rank holds. A layer cannot be split between stages, nor between replicas; tp halves it.
    profile = synthetic_profile([(1e-4, 100.0, 1_000_000.0)], 2)
    kwargs: dict[str, Any] = {"ranks": 2, "memory_per_rank": 3_000_000,
                              "link": Link("gloo", 1e-5, 1e-9)}
    with pytest.raises(PlanError, match="smallest budget that fits"):
        plan_profile(profile, **kwargs)
    p = plan_profile(profile, sharding=full_sharding(profile), **kwargs)
    assert (p.dp, p.pp, p.tp) == (1, 1, 2)
    assert max(p.predicted_peak_bytes) <= 3_000_000
    assert "dp 1 x pp 1 x tp 2" in p.summary() and "1 x 1 x 2" in p.table()


def _tp_plan_of_the_transformer(**kw: Any) -> Plan:
    spec = get_model("transformer")
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    torch.manual_seed(0)
    return plan(model, x, y, loss, ranks=2, memory_per_rank=None, transport="gloo",
                link=Link("gloo", 1e-5, 1e-10), contention=1.0, chunks=[1, 2], repeats=1,
                tp_plan=_TP_PLAN, **kw)


def test_a_tp_plan_builds_its_pipe_on_a_3d_mesh() -> None:
    p = _tp_plan_of_the_transformer(tp_sizes=[2])
    assert (p.dp, p.pp, p.tp) == (1, 1, 2) and {c.tp for c in p.candidates} == {2}
    with pytest.raises(PipeConfigError) as info:
        p.pipe_kwargs()
    message = str(info.value)
    assert "init_device_mesh(device, (1, 1, 2), mesh_dim_names=('dp', 'pp', 'tp'))" in message
    assert "mesh_dim_names=('pp', 'tp')" in message  # one replica: a 2-D mesh does too
    mesh = object()
    kwargs = p.pipe_kwargs(mesh=mesh)
    assert kwargs["mesh"] is mesh and kwargs["tp_plan"] == _TP_PLAN
    assert kwargs["balance"] == list(p.balance) and "devices" not in kwargs


def test_a_plan_from_a_profile_asks_for_the_tp_plan() -> None:
    profile = synthetic_profile([(1e-4, 100.0, 1_000_000.0)], 2)
    p = plan_profile(profile, ranks=2, memory_per_rank=3_000_000, sharding=full_sharding(
        profile), link=Link("gloo", 1e-5, 1e-9))
    with pytest.raises(PipeConfigError, match="pass tp_plan="):
        p.pipe_kwargs(mesh=object())
    assert "tp_plan" in p.pipe_kwargs(mesh=object(), tp_plan={"x": "colwise"})


@pytest.mark.parametrize("kwargs, message", [
    ({"tp_sizes": [3]}, "do not divide both ranks_per_host=2"),
    ({"tp_sizes": [4], "ranks_per_host": 4}, "do not divide both"),
    ({"tp_sizes": [0]}, "must be an int >= 1"),
    ({"ranks_per_host": 0}, "ranks_per_host must be an int >= 1"),
])
def test_bad_tp_arguments_say_the_rule(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PipeConfigError, match=message):
        _tp_plan_of_the_transformer(**kwargs)


def test_tp_needs_processes_and_a_plan() -> None:
    profile = synthetic_profile([(1e-4, 100.0, 1000.0)] * 2, 2)
    spec = get_model("transformer")
    model, (x, y), loss = spec.build(), spec.batch(), spec.loss()
    with pytest.raises(PipeConfigError, match="tensor parallelism runs one process per rank"):
        plan(model, x, y, loss, ranks=2, memory_per_rank=None, tp_plan=_TP_PLAN)
    with pytest.raises(PipeConfigError, match="pass tp_plan="):
        plan_profile(profile, ranks=2, memory_per_rank=None, link=Link("gloo", 0.0, 0.0),
                     tp_sizes=[2])
    with pytest.raises(PipeConfigError, match="do not fill whole hosts"):
        plan_profile(profile, ranks=6, memory_per_rank=None, link=Link("gloo", 0.0, 0.0),
                     ranks_per_host=4)
