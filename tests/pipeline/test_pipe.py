import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

import pipeline.splitting.config as pipe_module
import schedules
from pipeline import Pipe, PipeConfigError, PipelineError, is_recomputing
from pipeline.runtime.microbatch import MicroBatchError
from pipeline.splitting.partition import BalanceError

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, summation order only (see test_transparency)


def _mlp(n: int = 6, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)])

def _step_matches(pipe: Pipe, model: nn.Module, reference: nn.Module, x: Any, y: Any) -> None:
    """One pipe step leaves the loss and gradients a plain step of `reference` leaves."""
    loss = pipe.step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)



# -- configuration errors
def test_config_errors_say_what_to_do() -> None:
    with pytest.raises(PipeConfigError, match=r"takes an nn.Sequential, or any model with "
                                              r"example_inputs="):
        Pipe(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(BalanceError, match="model: 6 layers, sum of balance \\[2, 2\\]: 4"):
        Pipe(_mlp(), [2, 2])
    # Which layers are left over or missing, and a balance that fits.
    with pytest.raises(BalanceError, match=r"layers 4 to 5 \(Sequential, Sequential\) are in "
                                           r"no stage.*balance=\[3, 3\]"):
        Pipe(_mlp(), [2, 2])
    with pytest.raises(BalanceError, match=r"asks for 3 layers more than the model's 6.*"
                                           r"balance=\[2, 2, 2\]"):
        Pipe(_mlp(), [3, 3, 3])
    with pytest.raises(BalanceError, match="at least one layer"):
        Pipe(_mlp(), [6, 0])
    with pytest.raises(BalanceError, match="cannot split 6 layers into 7 stages"):
        Pipe(_mlp(), stages=7)
    with pytest.raises(PipeConfigError, match="need 2 ranks, got 3 devices"):
        Pipe(_mlp(), [3, 3], devices=["cpu"] * 3)
    with pytest.raises(PipeConfigError, match="unknown schedule 'pipedream'; known: gpipe"):
        Pipe(_mlp(), [3, 3], schedule="pipedream")
    with pytest.raises(PipeConfigError, match="checkpoint must be one of"):
        Pipe(_mlp(), [3, 3], checkpoint="sometimes")
    with pytest.raises(PipeConfigError, match="pass sample="):
        Pipe(_mlp(), "time", stages=2)
    with pytest.raises(MicroBatchError, match="chunks <= 3"):
        Pipe(_mlp(), [3, 3], chunks=4).step(torch.randn(3, 8), torch.randn(3, 8), nn.MSELoss())


def test_a_module_used_by_two_stages_is_refused_naming_the_models_keys() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Tanh(), shared, nn.Tanh(), shared)
    with pytest.raises(PipeConfigError, match=r"'3.weight' \(stage 1\) and '1.weight' "
                                              r"\(stage 0\) are the same Linear object"):
        Pipe(model, [2, 2])
    Pipe(model, [4])  # both uses in one stage: fine


def test_balance_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Pipe(_mlp(), stages=4).balance == [2, 2, 1, 1]
    assert Pipe(_mlp(), "params", stages=3).balance == [2, 2, 2]
    # "time" partitions what the profiler measured on the sample given (timings themselves are
    # tested in test_profile.py; here they are fixed so the expected split is exact).
    sample = torch.randn(4, 8)
    profiled: list[Any] = []

    def measured(model: nn.Sequential, got: Any) -> list[float]:
        profiled.append(got)
        return [4.0, 1.0, 1.0, 1.0, 1.0, 4.0]

    monkeypatch.setattr(pipe_module, "layer_times", measured)
    # The only split with no stage above 4 (uniform would be [2, 2, 2]).
    assert Pipe(_mlp(), "time", stages=3, sample=sample).balance == [1, 4, 1]
    assert profiled == [sample]
    # Six identical layers: "size" (deterministic bytes) splits them evenly.
    assert Pipe(_mlp(), "size", stages=3, sample=sample).balance == [2, 2, 2]
    assert Pipe(_mlp(), stages=3, schedule="interleaved", devices=["cpu"]).num_ranks == 1
    assert Pipe(_mlp(), schedule="interleaved", devices=["cpu", "cpu"]).balance == [2, 2, 1, 1]


def test_uses_the_models_own_parameters_and_keys() -> None:
    model = _mlp()
    pipe = Pipe(model, [2, 4])
    assert [id(p) for p in pipe.parameters()] == [id(p) for p in model.parameters()]
    assert list(pipe.state_dict()) == list(model.state_dict())
    other = _mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    pipe.load_state_dict(other.state_dict())
    x = torch.randn(5, 8)
    torch.testing.assert_close(pipe(x), other(x), rtol=0, atol=0)
    fresh = _mlp()
    fresh.load_state_dict(pipe.state_dict())  # a pipelined checkpoint loads into a plain model
    torch.testing.assert_close(fresh(x), other(x), rtol=0, atol=0)


# -- data that does not need gradients
class _Masked(nn.Module):
    """Returns (hidden, bool mask): a tuple crossing a stage boundary."""

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, h.sum(-1, keepdim=True) > 0


class _ApplyMask(nn.Module):
    def forward(self, hidden_and_mask: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = hidden_and_mask  # nn.Sequential hands a tuple over as one argument
        return h * mask


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_embedding_ids_and_bool_mask_cross_stages(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), _Masked(), _ApplyMask(),
                          nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 20, (9, 5))
    y = torch.randn(9, 5, 3)
    pipe = Pipe(model, [1, 2, 2], chunks=3, schedule=schedule, checkpoint="always")
    _step_matches(pipe, model, reference, ids, y)


# -- PipeDream-2BW
def _two_bw_reference(model: nn.Sequential, data: list[tuple[torch.Tensor, torch.Tensor]],
                      lr: float, loss_fn: Any = None) -> list[float]:
    """W(t+1) = W(t) - lr * grad f(W(t-1)), step 0 at the initial weights, on one device."""
    previous = copy.deepcopy(model)
    losses = []
    for x, y in data:
        stale = copy.deepcopy(previous)  # W(t-1)
        loss = (loss_fn or nn.MSELoss())(stale(x), y)
        loss.backward()
        losses.append(loss.item())
        previous = copy.deepcopy(model)  # W(t), before the update
        with torch.no_grad():
            for p, q in zip(model.parameters(), stale.parameters(), strict=True):
                p.sub_(lr * q.grad)
    return losses


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(5)
    return [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]


def test_2bw_step_follows_the_stale_update_rule() -> None:
    model, data, lr = _mlp(), _data(), 0.5
    reference = copy.deepcopy(model)
    expected = _two_bw_reference(reference, data, lr)
    pipe = Pipe(model, [3, 3], chunks=4, schedule="2bw")
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    for (x, y), want in zip(data, expected, strict=True):
        opt.zero_grad()
        assert pipe.step(x, y, nn.MSELoss()).item() == pytest.approx(want, rel=1e-5)
        opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_2bw_many_batches_without_flush_same_numerics(chunks: int) -> None:
    model, data, lr = _mlp(), _data(), 0.5
    reference = copy.deepcopy(model)
    expected = _two_bw_reference(reference, data, lr)
    pipe = Pipe(model, [2, 2, 2], chunks=chunks, schedule="2bw", checkpoint="except_last")
    losses = pipe.step_many(data, nn.MSELoss(), torch.optim.SGD(pipe.parameters(), lr=lr))
    assert [v.item() for v in losses] == pytest.approx(expected, rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
    # The run was one schedule: batch 1 started before batch 0's updates finished.
    timeline = pipe.last_timeline()
    first = {str(e.action): e.start for e in timeline.events}
    assert first["0F4v1" if chunks == 4 else f"0F{chunks}v1"] < first["1U0"]


def test_step_many_for_flush_schedules_is_step_then_optimizer() -> None:
    model, data = _mlp(), _data()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        ref_opt.zero_grad()
        nn.MSELoss()(reference(x), y).backward()
        ref_opt.step()
    pipe = Pipe(model, [3, 3], chunks=2)
    pipe.step_many(data, nn.MSELoss(), torch.optim.SGD(pipe.parameters(), lr=0.1))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)


# -- memory
def test_checkpoint_always_stashes_only_stage_inputs() -> None:
    width, rows, chunks = 32, 12, 4
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)])
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    stats = {}
    for mode in ("always", "never"):
        pipe = Pipe(model, [2, 2], chunks=chunks, checkpoint=mode, track_memory=True)
        pipe.step(x, y, nn.MSELoss())
        stats[mode] = pipe.memory_stats()
    input_bytes = (rows // chunks) * width * 4  # one micro-batch of a stage's input
    for rank, s in enumerate(stats["always"]):
        assert s["peak_stashed_bytes"] == s["peak_stashed_microbatches"] * input_bytes, rank
        # Without recomputation the same micro-batches also keep what autograd saved.
        assert stats["never"][rank]["peak_stashed_bytes"] > 2 * s["peak_stashed_bytes"]


# -- recomputation hook
class _CountsReplays(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(is_recomputing())
        return self.linear(x)


def test_is_recomputing_marks_only_the_replay() -> None:
    layer = _CountsReplays()
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), layer), [1, 1], chunks=3,
                checkpoint="except_last")
    pipe.step(torch.randn(6, 4), torch.randn(6, 4), nn.MSELoss())
    assert layer.calls.count(False) == 3  # one forward per micro-batch
    assert layer.calls.count(True) == 2  # replays: all but the last micro-batch


# -- failures
class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2:  # only the last, smaller micro-batch
            raise ValueError("bad micro-batch")
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_failure_in_a_middle_stage_names_it_and_hangs_nobody(schedule: str) -> None:
    before = set(threading.enumerate())
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _Boom(), nn.Linear(4, 4))
    pipe = Pipe(model, [1, 2, 1], chunks=3, schedule=schedule, timeout=30)
    workers = {t for t in set(threading.enumerate()) - before if t.name.startswith("pipe-rank")}
    assert len(workers) == 3
    with pytest.raises(PipelineError, match=r"rank 1 \(cpu\) failed at 1F2 \(forward of stage 1, "
                                            r"micro-batch 2\): ValueError: bad micro-batch"):
        pipe.step(torch.randn(8, 4), torch.randn(8, 4), nn.MSELoss())
    # Nobody is left waiting: every rank's worker took the next step (9 rows: no bad chunk).
    assert torch.isfinite(pipe.step(torch.randn(9, 4), torch.randn(9, 4), nn.MSELoss()))
    pipe.close()
    for t in workers:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in workers)


def test_loss_must_be_a_scalar() -> None:
    pipe = Pipe(_mlp(2), [1, 1], chunks=2)
    with pytest.raises(PipelineError, match="loss_fn must return a 0-dim tensor"):
        # (a loss module with reduction="none" is refused before the step: see
        # tests/pipeline/runtime/test_loss_reduction.py)
        pipe.step(torch.randn(4, 8), torch.randn(4, 8), lambda out, target: (out - target) ** 2)


def test_custom_schedule_object() -> None:
    s = schedules.get_schedule("1f1b", 2, 3)
    model = _mlp()
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [3, 3], chunks=3, schedule=s)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    pipe.step(x, y, nn.MSELoss())
    nn.MSELoss()(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    with pytest.raises(PipeConfigError, match="micro-batches"):
        Pipe(model, [3, 3], chunks=2, schedule=s).step(x, y, nn.MSELoss())


def test_timeline_exports() -> None:
    pipe = Pipe(_mlp(), [3, 3], chunks=2)
    with pytest.raises(RuntimeError, match="no step has run yet"):
        pipe.last_timeline()
    pipe.step(torch.randn(4, 8), torch.randn(4, 8), nn.MSELoss())
    t = pipe.last_timeline()
    assert t.unit == "s" and len(t.events) == 8
    assert schedules.Timeline.from_json(t.to_json()) == t
    assert len([e for e in t.to_chrome_trace()["traceEvents"] if e["ph"] == "X"]) == 8


def test_a_registered_generator_runs_by_its_metadata_alone() -> None:
    # A looped GPipe with v stages per rank: Pipe learns v from the registry, not the name.
    from schedules.registry import _GENERATORS

    @schedules.register("test-looped-gpipe", stages_per_rank=2, stages_option="virtual")
    def looped(num_ranks: int, num_microbatches: int, virtual: int = 2) -> schedules.Schedule:
        p, m, n = num_ranks, num_microbatches, num_ranks * virtual
        rows = tuple(
            tuple(schedules.Action(s, schedules.Op.F, i) for s in range(r, n, p)
                  for i in range(m))
            + tuple(schedules.Action(s, schedules.Op.B, i) for s in reversed(range(r, n, p))
                    for i in range(m))
            for r in range(p))
        return schedules.Schedule(p, n, m, rows, name="test-looped-gpipe")

    try:
        for balance in ([1, 1, 2, 2], [1, 1, 1, 1, 1, 1]):
            model = _mlp()
            reference = copy.deepcopy(model)
            pipe = Pipe(model, balance, devices=["cpu", "cpu"], chunks=3,
                        schedule="test-looped-gpipe")
            assert pipe.num_ranks == 2 and len(pipe.local_stages) == len(balance)
            _step_matches(pipe, model, reference, torch.randn(7, 8), torch.randn(7, 8))
            stages = {e.action.stage for e in pipe.last_timeline().events if e.rank == 1}
            assert stages == set(range(1, len(balance), 2))
            pipe.close()
    finally:
        del _GENERATORS["test-looped-gpipe"]


def test_schedules_are_built_once_per_shape() -> None:
    pipe = Pipe(_mlp(), [3, 3], chunks=2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, y, nn.MSELoss())
    first = pipe._programs.schedule(2, 1)
    assert first.has_comms  # the runtime executes the lowered form
    pipe.step(x, y, nn.MSELoss())
    assert pipe._programs.schedule(2, 1) is first


def test_a_stage_count_that_misfits_the_schedule_says_what_to_give() -> None:
    """One balance entry per rank for a schedule of two stages per rank was refused naming the
    rule alone ("needs stages_per_rank >= 2", "2 stages at 2 per rank need 1 ranks"); the
    message says how many entries to give for these ranks."""
    with pytest.raises(PipeConfigError, match=r"Give stages_per_rank x ranks balance entries "
                                              r".*e\.g\. 4 for 2 devices"):
        Pipe(_mlp(), [3, 3], devices=["cpu"] * 2, schedule="interleaved")
    with pytest.raises(PipeConfigError, match=r"e\.g\. 8 for 4 devices"):
        Pipe(_mlp(), [1] * 6, devices=["cpu"] * 4, schedule="interleaved")
    with pytest.raises(PipeConfigError, match=r"give 2 x devices stages: a balance of 4 "
                                              r"entries \(or stages=4\) for 2 devices"):
        Pipe(_mlp(), [3, 3], devices=["cpu"] * 2, schedule="zb-v")
    with pytest.raises(PipeConfigError, match=r"give 2 x devices stages: a balance of 6 "):
        Pipe(_mlp(), stages=4, devices=["cpu"] * 3, schedule="dualpipe-v")
    with pytest.raises(PipeConfigError, match=r"a multiple of 2 stages"):
        Pipe(_mlp(), [2, 2, 2], schedule="zb-v")
    Pipe(_mlp(), [2, 1, 2, 1], devices=["cpu"] * 2, schedule="zb-v").close()
    Pipe(_mlp(), [2, 1, 2, 1], devices=["cpu"] * 2, schedule="interleaved").close()
