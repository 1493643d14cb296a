"""pipeline.runtime.stage: one rank's StageRuntime runs a lowered action list, whatever made it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import schedules
from pipeline.comm.threads import ThreadTransport
from pipeline.runtime.stage import StageRuntime, StepInputs, StepResult
from schedules import Op

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, summation order only (see test_transparency)


def _parts() -> list[nn.Sequential]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 2))]


def _runtime(parts: list[nn.Sequential], schedule: schedules.Schedule) -> StageRuntime:
    """Rank 0 holding every stage of a one-rank schedule: all data stays on this rank."""
    return StageRuntime(0, dict(enumerate(parts)), torch.device("cpu"), len(parts),
                        schedule.rank_of, ThreadTransport(timeout=5.0))


def _one_rank(name: str, m: int) -> schedules.Schedule:
    # interleaved with one rank and two stages per rank: both stages on rank 0
    return schedules.lower(schedules.get_schedule(name, 1, m, stages_per_rank=2))


def _step(x: torch.Tensor, y: torch.Tensor, m: int, *, checkpointed: bool = False,
          loss_fn: nn.Module | None = None) -> StepInputs:
    rows = [c.shape[0] / x.shape[0] for c in torch.tensor_split(x, m)]
    return StepInputs([(c,) for c in torch.tensor_split(x, m)], list(torch.tensor_split(y, m)),
                      loss_fn, rows, [checkpointed] * m, seed=7)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_forward_and_backward_leave_the_plain_gradients(checkpointed: bool) -> None:
    parts = _parts()
    reference = copy.deepcopy(nn.Sequential(*parts))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    schedule = _one_rank("interleaved", 3)
    result = StepResult()
    rt = _runtime(parts, schedule)
    rt.run(schedule.actions[0], _step(x, y, 3, checkpointed=checkpointed,
                                      loss_fn=nn.MSELoss()), result)
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    assert sorted(result.losses) == [0, 1, 2]
    torch.testing.assert_close(sum(result.losses.values()), expected.detach(), **TOL)
    for p, q in zip(nn.Sequential(*parts).parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    # One event per compute action, in the order run, within the step's clock.
    computed = [a for a in schedule.actions[0] if a.is_compute]
    assert [e.action for e in rt.events] == computed
    assert all(0 <= e.start <= e.end for e in rt.events)
    # Stashed micro-batches are all freed by the end; the peak is the schedule's own.
    assert rt.peak_stashed == schedules.simulate(schedule).peak_activations[0]
    assert rt.stashed_bytes == 0 and rt.peak_stashed_bytes > 0


def test_forward_only_returns_the_last_stages_outputs() -> None:
    parts = _parts()
    x = torch.randn(5, 4)
    compute = schedules.get_schedule("interleaved", 1, 2, stages_per_rank=2)
    forward = compute.replace(actions=tuple(tuple(a for a in row if a.op is Op.F)
                                            for row in compute.actions))
    schedule = schedules.lower(forward)
    result = StepResult()
    with torch.no_grad():
        _runtime(parts, schedule).run(schedule.actions[0], _step(x, x, 2), result)
    assert sorted(result.outputs) == [0, 1] and not result.losses
    out = torch.cat([result.outputs[0][0], result.outputs[1][0]])
    torch.testing.assert_close(out, nn.Sequential(*parts)(x), **TOL)
    assert not out.requires_grad


def test_a_loss_that_is_not_a_scalar_is_refused_with_its_shape() -> None:
    parts = _parts()
    schedule = _one_rank("interleaved", 1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with pytest.raises(TypeError, match=r"0-dim tensor .* shape torch.Size\(\[3, 2\]\)"):
        _runtime(parts, schedule).run(schedule.actions[0],
                                      _step(x, y, 1, loss_fn=nn.MSELoss(reduction="none")),
                                      StepResult())


def test_an_incomplete_action_list_is_an_internal_error() -> None:
    """Pins an internal invariant: a forward whose backward never runs is reported, not
    leaked (validated schedules never do this)."""
    parts = _parts()
    schedule = _one_rank("interleaved", 1)
    forwards = [a for a in schedule.actions[0] if a.op is Op.F]
    with pytest.raises(AssertionError, match="stashed"):
        _runtime(parts, schedule).run(forwards, _step(torch.randn(2, 4), torch.randn(2, 2), 1,
                                                      loss_fn=nn.MSELoss()), StepResult())
