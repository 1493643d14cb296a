"""Pipelined training equals the single-device model: loss and every parameter's gradient.

Tolerance. The pipeline sums micro-batch gradients (weighted by size) where the plain run
reduces the whole batch at once, so the two differ by summation order only; that rounding is
amplified by the conditioning of the layers on the way (a LayerNorm over few features, a
saturated tanh, a narrow linear layer all magnify it), which random models cannot bound: in
fp32 a drawn Linear(19, 2) + LayerNorm(2) once differed by 1e-4 relative. So the property test
compares in float64 (unit roundoff 1.1e-16): rtol 1e-9 leaves 2^29 times more room than fp32
for the same amplification (the worst seen in fp32, ~2e3 ulps, is 2e-13 here), while any real
error (a micro-batch weighted wrongly, a gradient missing, a cast to fp32) is 1e-8 or more. Its
absolute tolerance is relative to the gradients' scale (rtol x the largest reference gradient
entry of the model): entries far below that scale carry the rounding of the large ones. The
fixed-model tests below stay in fp32 with rtol=1e-5, atol=1e-6 (gradients there are O(1),
well conditioned): a few ulps per accumulated term for up to 8 chunks.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import schedules
from pipeline import Pipe
from schedules.auto_greedy import FILLS, Policy, greedy
from tests.models_graphs import build_graph, graph_loss
from tests.pipeline.reference import build, seeded_microbatch_step
from tests.strategies import auto_costs, balances, sequential_specs, stage_graphs

SCHEDULES = schedules.available()  # every registered generator, by its metadata
MODES = ("never", "except_last", "always")
TOL = {"rtol": 1e-5, "atol": 1e-6}
RTOL_64 = 1e-9  # float64, see the module docstring


def _per_rank(schedule: str) -> int:
    return schedules.info(schedule).stages_per_rank


def _balance(schedule: str, per_stage: list[int]) -> list[int]:
    """`per_stage` layers per stage for one-stage-per-rank schedules; each stage split evenly
    into that schedule's stages per rank otherwise (the layer count stays the same)."""
    k = _per_rank(schedule)
    return [size // k + (i < size % k) for size in per_stage for i in range(k)]


def _stages_for(schedule: str, num_layers: int, draw_ranks: int) -> tuple[int, int]:
    per_rank = _per_rank(schedule)
    ranks = max(1, min(draw_ranks, num_layers // per_rank))
    return ranks * per_rank, ranks


def _schedule_arg(schedule: str, num_stages: int, chunks: int,
                  data: st.DataObject) -> str | schedules.Schedule:
    """`schedule`, or for "auto" half the time an order its heuristic places for drawn
    unequal costs, caps and W policy: by name, "auto" is zb-h1 (unit costs), and `search`
    picks a fixed schedule or one of these orders, so every order it can return runs."""
    if schedule != "auto" or not data.draw(st.booleans(), label="synthesised"):
        return schedule
    costs, _ = data.draw(auto_costs(num_stages, chunks), label="auto costs")
    caps = data.draw(st.lists(st.integers(1, chunks), min_size=num_stages,
                              max_size=num_stages), label="caps")
    policy = Policy(tuple(caps), data.draw(st.sampled_from(FILLS), label="fill"))
    return greedy(num_stages, chunks, costs, policy)


def _assert_same_grads(pipe_model: nn.Module, ref_model: nn.Module,
                       tol: dict[str, float] | None = None) -> None:
    for (name, p), q in zip(pipe_model.named_parameters(), ref_model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **(tol or TOL),
                                       msg=lambda m, n=name: f"{n}: {m}")


def _scaled_tol(model: nn.Module, rtol: float) -> dict[str, float]:
    """rtol, and an atol of rtol times the largest gradient entry of `model` (its scale)."""
    scale = max((float(p.grad.abs().max()) for p in model.parameters()
                 if p.grad is not None and p.grad.numel()), default=0.0)
    return {"rtol": rtol, "atol": rtol * max(scale, 1e-30)}


@settings(max_examples=80)
@given(spec=sequential_specs(), schedule=st.sampled_from(SCHEDULES),
       checkpoint=st.sampled_from(MODES), ranks=st.integers(1, 4), data=st.data())
def test_pipe_equals_single_device(spec: dict[str, Any], schedule: str, checkpoint: str,
                                   ranks: int, data: st.DataObject) -> None:
    model, x, y = build(spec, dtype=torch.float64)
    num_stages, _ = _stages_for(schedule, len(model), ranks)
    balance = data.draw(balances(len(model), num_stages)) if num_stages > 1 else [len(model)]
    reference = copy.deepcopy(model)
    loss_fn = nn.MSELoss()
    arg = _schedule_arg(schedule, num_stages, spec["chunks"], data)
    pipe = Pipe(model, balance, chunks=spec["chunks"], schedule=arg, checkpoint=checkpoint)
    torch.manual_seed(spec["seed"] + 1)
    loss = pipe.step(x, y, loss_fn)
    if any(isinstance(layer, nn.Dropout) for layer in model):
        # Dropout draws per (stage, micro-batch): the reference replays the same seeds.
        torch.manual_seed(spec["seed"] + 1)
        step_seed = int(torch.randint(0, 2**62, (1,)).item())
        expected = seeded_microbatch_step(reference, balance, x, y, loss_fn, spec["chunks"],
                                          step_seed)
    else:
        expected = loss_fn(reference(x), y)
        expected.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL_64, atol=0.0)
    _assert_same_grads(model, reference, _scaled_tol(reference, RTOL_64))


@given(spec=sequential_specs(), checkpoint=st.sampled_from(MODES), ranks=st.integers(2, 4),
       data=st.data())
def test_auto_orders_equal_single_device(spec: dict[str, Any], checkpoint: str, ranks: int,
                                         data: st.DataObject) -> None:
    """Orders `auto` places for unequal stages (drawn costs, caps and W policy), every time:
    the property test above draws "auto" among all schedules, and seldom."""
    model, x, y = build(spec, dtype=torch.float64)
    num_stages = max(1, min(ranks, len(model)))
    balance = data.draw(balances(len(model), num_stages)) if num_stages > 1 else [len(model)]
    reference = copy.deepcopy(model)
    costs, _ = data.draw(auto_costs(num_stages, spec["chunks"]), label="auto costs")
    caps = data.draw(st.lists(st.integers(1, spec["chunks"]), min_size=num_stages,
                              max_size=num_stages), label="caps")
    order = greedy(num_stages, spec["chunks"], costs,
                   Policy(tuple(caps), data.draw(st.sampled_from(FILLS), label="fill")))
    pipe = Pipe(model, balance, chunks=spec["chunks"], schedule=order, checkpoint=checkpoint)
    torch.manual_seed(spec["seed"] + 1)
    loss = pipe.step(x, y, nn.MSELoss())
    if any(isinstance(layer, nn.Dropout) for layer in model):  # draws per stage, micro-batch
        torch.manual_seed(spec["seed"] + 1)
        step_seed = int(torch.randint(0, 2**62, (1,)).item())
        expected = seeded_microbatch_step(reference, balance, x, y, nn.MSELoss(),
                                          spec["chunks"], step_seed)
    else:
        expected = nn.MSELoss()(reference(x), y)
        expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL_64, atol=0.0)
    _assert_same_grads(model, reference, _scaled_tol(reference, RTOL_64))


@settings(max_examples=150)
@given(spec=stage_graphs(), schedule=st.sampled_from(SCHEDULES),
       checkpoint=st.sampled_from(MODES), ranks=st.integers(1, 3), data=st.data())
def test_any_stage_graph_equals_single_device(spec: dict[str, Any], schedule: str,
                                              checkpoint: str, ranks: int,
                                              data: st.DataObject) -> None:
    """Graph shapes, not only sizes: branches that never meet a stage's incoming activations
    (side inputs, values made from parameters alone), values crossing several stages, one
    value returned twice, parameters used twice in a stage or tied across stages. The split
    backward (zb-*, dualpipe-v) must leave every gradient the plain backward leaves."""
    model, x, y = build_graph(spec)
    num_stages, _ = _stages_for(schedule, len(model), ranks)
    balance = data.draw(balances(len(model), num_stages)) if num_stages > 1 else [len(model)]
    reference = copy.deepcopy(model)
    arg = _schedule_arg(schedule, num_stages, spec["chunks"], data)
    pipe = Pipe(model, balance, chunks=spec["chunks"], schedule=arg, checkpoint=checkpoint)
    try:
        loss = pipe.step(x, y, graph_loss)
    finally:
        pipe.close()
    expected = graph_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL_64, atol=0.0)
    tol = _scaled_tol(reference, RTOL_64)
    want = dict(reference.named_parameters())
    got = dict(pipe.named_parameters())
    assert sorted(got) == sorted(want)
    for name, q in want.items():
        p = got[name]
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_every_schedule_and_mode_on_uneven_chunks(schedule: str, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32),
                          nn.Tanh(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    x, y = torch.randn(10, 6), torch.randn(10, 3)  # 10 rows in 4 chunks: 3, 3, 2, 2
    balance = [2, 2, 2, 2] if _per_rank(schedule) == 2 else [3, 3, 2]
    pipe = Pipe(model, balance, chunks=4, schedule=schedule, checkpoint=checkpoint)
    loss = pipe.step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    _assert_same_grads(model, reference)
    # The recorded timeline is the schedule as it ran.
    ran = pipe.last_timeline()
    actions = pipe._programs.schedule(4, 1).actions
    assert len(ran.events) == sum(a.is_compute for row in actions for a in row)


def test_dropout_under_always_replays_the_mask() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.GELU(), nn.Linear(64, 64),
                          nn.Dropout(0.5), nn.Linear(64, 2))
    grads = {}
    for schedule, checkpoint in (("1f1b", "never"), ("gpipe", "always"), ("zb-h1", "always")):
        m = copy.deepcopy(model)
        pipe = Pipe(m, [2, 2, 2], chunks=3, schedule=schedule, checkpoint=checkpoint)
        torch.manual_seed(11)
        loss = pipe.step(torch.ones(6, 8), torch.zeros(6, 2), nn.MSELoss())
        grads[(schedule, checkpoint)] = (loss, [p.grad.clone() for p in m.parameters()])
    (l0, g0), *rest = grads.values()
    for loss, g in rest:  # same seed: same masks whatever the schedule and recompute mode
        torch.testing.assert_close(loss, l0, rtol=0, atol=0)
        for a, b in zip(g, g0, strict=True):
            torch.testing.assert_close(a, b, **TOL)
    # A different seed draws different masks (so the above is not vacuous).
    m = copy.deepcopy(model)
    torch.manual_seed(12)
    other = Pipe(m, [2, 2, 2], chunks=3).step(torch.ones(6, 8), torch.zeros(6, 2), nn.MSELoss())
    assert not torch.equal(other, l0)


def test_forward_equals_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.GELU(), nn.Linear(7, 2))
    for schedule in SCHEDULES:
        balance = _balance(schedule, [2, 3])
        pipe = Pipe(model, balance, chunks=3, schedule=schedule)
        x = torch.randn(11, 5)
        torch.testing.assert_close(pipe(x), model(x), **TOL)  # chunked matmuls: ulps at most


def test_simulated_and_measured_peaks_agree() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    for schedule in SCHEDULES:
        balance = _balance(schedule, [2] * 4)
        pipe = Pipe(model, balance, chunks=6, schedule=schedule)
        # The order the step runs, taken before it: "auto" runs its unit-cost order first and
        # synthesises another from the step's timing, which the step did not run (comparing
        # with that one failed when the measured costs gave another order).
        plan = schedules.simulate(pipe._programs.schedule(6, 1))
        pipe.step(torch.randn(12, 4), torch.randn(12, 4), nn.MSELoss())
        assert [s["peak_stashed_microbatches"] for s in pipe.memory_stats()] == list(
            plan.peak_activations), schedule
