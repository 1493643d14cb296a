"""`Pipe(..., schedule="auto")`: the first step measured, the synthesised order trained exactly."""

from __future__ import annotations

import copy
import gc
import json
import weakref

import pytest
import torch
from torch import nn

import schedules
from pipeline import Pipe, PipeConfigError, PipelineError
from pipeline.auto_schedule import stage_costs
from pipeline.launch import spawn
from schedules import Action, Costs, Event, Op
from schedules.auto import search
from tests.limits import SPAWN_TIMEOUT
from tests.pipeline import auto_workers
from tests.pipeline.auto_workers import TOL, unequal_model


def _rows(schedule: schedules.Schedule) -> list[list[str]]:
    return [[str(a) for a in row] for row in schedule.actions]


def _ran(pipe: Pipe) -> list[list[str]]:
    """Each rank's compute actions of the last step, in the order it ran them."""
    out: list[list[str]] = [[] for _ in range(pipe.num_ranks)]
    for e in pipe.last_timeline().events:
        out[e.rank].append(str(e.action))
    return out


def _train_exactly(pipe: Pipe, reference: nn.Module, steps: int) -> list[list[list[str]]]:
    """SGD steps of `pipe` and of `reference` on one device: loss, gradients and weights equal
    at every step; returns what each step ran."""
    ours = torch.optim.SGD(pipe.parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    ran = []
    for step in range(steps):
        torch.manual_seed(step)
        x, y = torch.randn(10, 6), torch.randn(10, 3)  # uneven: 3, 3, 2, 2 rows
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        loss = pipe.step(x, y, nn.MSELoss())
        expected = nn.MSELoss()(reference(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), **TOL)
        for p, q in zip(pipe.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, k=step: f"{k}: {m}")
        ours.step()
        theirs.step()
        ran.append(_ran(pipe))
    for p, q in zip(pipe.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
    return ran


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_the_first_step_is_measured_and_the_synthesised_order_trains_exactly(
        checkpoint: str) -> None:
    # A head 8 times wider than the blocks. What the timings are is the machine's business (no
    # assertion on them): the order must be the one searched for the costs recorded, and run.
    model = unequal_model()
    pipe = Pipe(copy.deepcopy(model), [4, 3], chunks=4, schedule="auto",
                checkpoint=checkpoint)
    assert pipe.auto is not None and pipe.auto.measures
    assert pipe.auto.costs is None and pipe.auto.memory_limit == [2, 2]
    zb_h1 = schedules.get_schedule("zb-h1", 2, 4)
    assert _rows(pipe.auto.schedule) == _rows(zb_h1)  # the warm-up: unit costs
    ran = _train_exactly(pipe, model, steps=3)
    costs = pipe.auto.costs
    assert costs is not None
    for field in (costs.forward, costs.backward_input, costs.backward_weight):
        assert isinstance(field, tuple) and len(field) == 2 and min(field) > 0
    assert costs.backward == pytest.approx([i + w for i, w in zip(
        costs.backward_input, costs.backward_weight, strict=True)])  # type: ignore[arg-type]
    again = search(2, 4, costs, memory_limit=2)  # deterministic: the same inputs, one answer
    assert pipe.auto.synthesis is not None and pipe.auto.synthesis.chosen == again.chosen
    assert _rows(pipe.auto.schedule) == _rows(again.schedule)
    assert ran[0] == _rows(zb_h1)
    assert ran[1] == ran[2] == _rows(pipe.auto.schedule)  # the switch, after one step
    assert pipe.program().compute_only().actions == pipe.auto.schedule.actions
    pipe.close()


def test_given_costs_give_an_order_other_than_zb_h1_and_it_trains_exactly() -> None:
    # The second stage's W three times its I, the first's the other way round: under a limit
    # of 3 micro-batches the heuristic beats zb-h1 (23 against 25 simulated).
    model = unequal_model()
    pipe = Pipe(copy.deepcopy(model), [4, 3], chunks=4, schedule="auto", auto_memory=3)
    assert pipe.auto is not None
    costs = Costs(forward=[1, 1], backward_input=[1, 3], backward_weight=[3, 1],
                  backward=[4, 4], comm=0.5)
    chosen = pipe.auto.use(costs)
    assert pipe.auto.synthesis is not None
    assert pipe.auto.synthesis.chosen == "greedy(caps=3/3, fill=idle)"
    assert pipe.auto.synthesis.best_fixed == ("zb-h1", 25.0)
    assert _rows(chosen) != _rows(schedules.get_schedule("zb-h1", 2, 4))
    ran = _train_exactly(pipe, model, steps=2)
    assert ran == [_rows(chosen)] * 2  # given costs: nothing measured, no warm-up order
    assert pipe.auto.costs is costs
    pipe.close()


def test_a_memory_limit_bounds_the_warm_up_and_the_synthesised_order() -> None:
    model = unequal_model()
    pipe = Pipe(copy.deepcopy(model), [4, 3], chunks=4, schedule="auto", auto_memory=[1, 2])
    assert pipe.auto is not None
    warm_up = pipe.auto.schedule
    assert schedules.peak_activations(warm_up.actions) == (1, 1)  # not zb-h1's (2, 2)
    _train_exactly(pipe, model, steps=2)
    assert pipe.auto.costs is not None and pipe.auto.memory_limit == [1, 2]
    peaks = schedules.peak_activations(pipe.auto.schedule.actions)
    assert peaks[0] <= 1 and peaks[1] <= 2
    pipe.close()


@pytest.mark.parametrize(("schedule", "memory", "error"), [
    ("1f1b", 2, "auto_memory=2 limits the schedule that schedule='auto' synthesises, but "
                "schedule is '1f1b': pass schedule='auto' or drop auto_memory"),
    ("auto", 0, "auto_memory must be an int >= 1 or a list of one such int per rank (got 0)"),
    ("auto", True, "(got True)"),
    ("auto", [2, 2, 2], "(got [2, 2, 2])"),
    ("auto", "2", "(got '2')"),
])
def test_bad_auto_memory_is_refused(schedule: str, memory: object, error: str) -> None:
    with pytest.raises(PipeConfigError) as err:
        Pipe(unequal_model(), [4, 3], chunks=4, schedule=schedule,
             auto_memory=memory)  # type: ignore[arg-type]
    assert error in str(err.value)


def test_a_failed_first_step_measures_nothing_and_the_next_one_does() -> None:
    class _Once(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.failed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.failed:
                self.failed = True
                raise ValueError("bad stage")
            return x

    model = nn.Sequential(*unequal_model(), _Once())
    pipe = Pipe(model, [4, 4], chunks=4, schedule="auto")
    assert pipe.auto is not None
    with pytest.raises(PipelineError, match="ValueError: bad stage"):
        pipe.step(torch.randn(8, 6), torch.randn(8, 3), nn.MSELoss())
    assert pipe.auto.costs is None and pipe.auto.synthesis is None
    pipe.step(torch.randn(8, 6), torch.randn(8, 3), nn.MSELoss())
    assert pipe.auto.costs is not None
    pipe.close()


def test_stage_costs_are_medians_per_stage_and_a_whole_backward_halves() -> None:
    def ev(stage: int, op: Op, m: int, seconds: float) -> Event:
        return Event(stage, Action(stage, op, m), 1.0, 1.0 + seconds)

    events = [ev(0, Op.F, 0, 0.5), ev(0, Op.F, 1, 0.002), ev(0, Op.F, 2, 0.001),
              ev(0, Op.I, 0, 0.003), ev(0, Op.W, 0, 0.004),
              ev(1, Op.F, 0, 0.01), ev(1, Op.B, 0, 0.03), ev(1, Op.B, 1, 0.05)]
    assert stage_costs(events, [0, 1]) == {0: (0.002, 0.003, 0.004), 1: (0.01, 0.02, 0.02)}
    with pytest.raises(PipelineError, match="no forward of stage 2"):
        stage_costs(events, [2])


def test_measurements_travel_as_text_that_gives_every_rank_the_same_costs() -> None:
    pipe = Pipe(unequal_model(), [4, 3], chunks=2, schedule="auto")
    assert pipe.auto is not None
    pipe.step(torch.randn(4, 6), torch.randn(4, 3), nn.MSELoss())
    text = pipe.auto.measure()
    given = json.loads(text)
    assert sorted(given["stages"]) == ["0", "1"] and given["comm"] >= 0
    costs = pipe.auto.costs
    assert costs is not None
    assert [given["stages"][s][0] for s in ("0", "1")] == list(costs.forward)  # type: ignore[arg-type]
    pipe.close()


@pytest.mark.dist
def test_two_processes_synthesise_the_same_order_and_train_exactly() -> None:
    results = spawn(auto_workers.measured, 2, timeout=SPAWN_TIMEOUT)
    zb_h1 = _rows(schedules.get_schedule("zb-h1", 2, 4))
    assert results[0]["costs"] == results[1]["costs"]  # agreed, not each rank's own
    assert results[0]["chosen"] == results[1]["chosen"]
    assert results[0]["schedule"] == results[1]["schedule"]
    for rank, got in enumerate(results):
        assert got["warm_up"] == zb_h1
        assert got["ran"][0] == zb_h1[rank]
        assert got["ran"][1] == got["ran"][2] == got["schedule"][rank]


@pytest.mark.dist
def test_a_rank_failing_to_measure_fails_the_others_instead_of_hanging() -> None:
    results = spawn(auto_workers.unmeasurable, 2, timeout=SPAWN_TIMEOUT)
    for rank, (message, seconds) in enumerate(results):
        assert "rank 1 failed measuring schedule='auto''s costs: OSError: no clock" in message, (
            rank, message)
        assert seconds < auto_workers.FAILURE_TIMEOUT / 3, (rank, seconds)


def test_an_auto_pipe_goes_with_its_last_reference() -> None:
    # pipe.auto refers back to its Pipe weakly: no cycle keeps the rank threads alive until
    # the next garbage collection.
    gc.disable()
    try:
        pipe = Pipe(unequal_model(), [4, 3], chunks=2, schedule="auto")
        pipe.step(torch.randn(4, 6), torch.randn(4, 3), nn.MSELoss())
        gone = weakref.ref(pipe)
        del pipe
        assert gone() is None
    finally:
        gc.enable()
