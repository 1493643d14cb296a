"""CUDA paths: device placement, side-stream copies, NCCL. Skipped without enough GPUs."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.launch import spawn
from tests.limits import SPAWN_TIMEOUT
from tests.pipeline import dist_workers
from tests.pipeline.test_amp import autocast_matches_plain

pytestmark = pytest.mark.gpu
TOL = {"rtol": 1e-4, "atol": 1e-5}  # TF32 is off by default for matmuls; cuBLAS order differs


def _gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s)")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved", "2bw"])
def test_cuda_pipe_equals_single_device(schedule: str) -> None:
    _gpus(1)
    n = min(2, torch.cuda.device_count())
    devices = [f"cuda:{i % n}" for i in range(2)]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])
    reference = copy.deepcopy(model).cuda()
    x, y = torch.randn(24, 64), torch.randn(24, 64)
    balance = [2, 2, 2, 2] if schedule == "interleaved" else [4, 4]
    pipe = Pipe(model, balance, devices=devices, chunks=5, schedule=schedule,
                checkpoint="except_last")
    loss = pipe.step(x, y, nn.MSELoss())
    expected = nn.MSELoss()(reference(x.cuda()), y.cuda())
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach().cpu(), **TOL)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), **TOL)
    assert pipe(x).device == torch.device(devices[-1])


def test_dropout_replay_on_cuda() -> None:
    _gpus(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    grads = []
    for checkpoint in ("never", "always"):
        m = copy.deepcopy(model)
        pipe = Pipe(m, [2, 1], devices=["cuda:0", "cuda:0"], chunks=2, checkpoint=checkpoint)
        torch.manual_seed(7)
        pipe.step(torch.randn(8, 16), torch.randn(8, 4), nn.MSELoss())
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.dist
def test_nccl_two_ranks() -> None:
    _gpus(2)
    combos = [("1f1b", "never"), ("zb-h1", "always"), ("interleaved", "except_last")]
    balances = {"1f1b": [4, 4], "zb-h1": [4, 4], "interleaved": [2, 2, 2, 2]}
    assert spawn(dist_workers.equivalence, 2, combos, balances, backend="nccl",
                 timeout=SPAWN_TIMEOUT) == [6, 6]


@pytest.mark.dist
def test_two_processes_sharing_a_gpu_over_gloo() -> None:
    """gloo sends no CUDA tensor point to point: two ranks on one GPU stage their messages
    (activations, gradients, the loss, the configuration exchange) through host memory."""
    _gpus(1)
    combos = [("1f1b", "never"), ("zb-h1", "always")]
    balances = {"1f1b": [4, 4], "zb-h1": [4, 4]}
    assert spawn(dist_workers.equivalence, 2, combos, balances, (10, 7), ["cuda:0", "cuda:0"],
                 backend="gloo", timeout=SPAWN_TIMEOUT) == [4, 4]


def _shared_gpu_pipe(model: nn.Module, **kwargs: object) -> Pipe:
    n = min(2, torch.cuda.device_count())
    return Pipe(model, [2, 1], devices=[f"cuda:{i % n}" for i in range(2)], chunks=3,
                **kwargs)  # type: ignore[arg-type]


def test_bf16_autocast_on_cuda_matches_the_plain_model() -> None:
    _gpus(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    reference = copy.deepcopy(model).cuda()
    pipe = _shared_gpu_pipe(model)
    x, y = torch.randn(12, 32, device="cuda"), torch.randn(12, 8, device="cuda")
    autocast_matches_plain(pipe, model, reference, x, y, "cuda")


def test_fp16_grad_scaler_on_cuda() -> None:
    _gpus(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    pipe = _shared_gpu_pipe(model)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(12, 32, device="cuda"), torch.randn(12, 8, device="cuda")
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            losses.append(pipe.step(x, y, nn.MSELoss(), scaler=scaler).item())
        scaler.step(optimizer)
        scaler.update()
    assert losses[-1] < losses[0]
    model[2].weight.register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    with torch.autocast("cuda", dtype=torch.float16):
        pipe.step(x, y, nn.MSELoss(), scaler=scaler)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_memory_stats_report_cuda_peaks() -> None:
    _gpus(1)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    pipe = _shared_gpu_pipe(model)
    pipe.step(torch.randn(64, 256), torch.randn(64, 256), nn.MSELoss())
    stats = pipe.memory_stats()
    assert all(s["peak_allocated_bytes"] >= 64 * 1024 * 4 for s in stats)  # the hidden layer


def test_autocast_gradients_of_a_split_graph_on_cuda() -> None:
    """docs/gpus.md's figures: on CUDA, the split graph's bf16 gradients differ from eager's
    by less than bf16 itself costs against fp32 (printed beside torch's `ep.module()`)."""
    _gpus(1)
    from tests.pipeline.test_amp import export_autocast_gaps

    gaps = export_autocast_gaps("cuda")
    print("autocast gaps on", torch.cuda.get_device_name(0), gaps)
    assert isinstance(gaps["pipe_vs_eager"], float), gaps  # ours runs whatever torch's does
    assert gaps["pipe_vs_eager"] <= gaps["eager_vs_fp32"], gaps  # within bf16's own error


def test_traced_llama_on_cuda_takes_any_length() -> None:
    """A Llama split from its graph, both ranks on one GPU, captured at 12 tokens and trained
    at 16 and 7: loss and gradients equal the unsplit model's on the same GPU."""
    _gpus(1)
    pytest.importorskip("transformers")
    from tests.models_lengths import batch, length_case
    from tests.models_traced import token_count, token_loss

    case = length_case("llama")
    model, reference = case.model(), case.model().cuda()
    pipe = Pipe(model, example_inputs=case.inputs, split_points=[case.blocks[2]],
                devices=["cuda:0", "cuda:0"], chunks=4, schedule="1f1b")
    try:
        for seed, length in enumerate([16, 7]):
            inputs, labels = batch("llama", length, seed=seed + 1)
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            loss = pipe.step(inputs, labels, token_loss, loss_weight=token_count)
            on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v
                      for k, v in inputs.items()}
            expected = token_loss(reference(**on_gpu), labels.cuda())
            expected.backward()
            torch.testing.assert_close(loss.cpu(), expected.detach().cpu(), **TOL)
            want = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad.cpu(), want[name].grad.cpu(), **TOL,
                                           msg=lambda m, n=name, t=length: f"{t}, {n}: {m}")
    finally:
        pipe.close()


class _Spin(nn.Module):
    """A layer whose forward keeps the GPU busy for a known number of cycles, launched in
    microseconds: only the GPU's own clock sees how long it runs."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.lin, self.cycles = nn.Linear(8, 8), cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return self.lin(x)


def test_a_cuda_timeline_holds_the_gpus_times_not_the_launches() -> None:
    """The first stage's forward spins the GPU ~10 ms but launches in microseconds: its
    measured forwards last what the spin lasts alone (CUDA events, within 10 %: a spin's
    length varies with the GPU's clock), each rank's actions keep their order, and the step's
    span holds them all. Two GPUs: a rank each; one: a single rank (two ranks on one GPU
    share its stream, so each one's events would also hold the other's kernels)."""
    _gpus(1)
    cycles = 1 << 23
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    torch.cuda._sleep(cycles)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    spin = start.elapsed_time(end) / 1e3
    two = torch.cuda.device_count() >= 2
    model = nn.Sequential(_Spin(cycles), nn.Linear(8, 8))
    pipe = Pipe(model, [1, 1] if two else [2], devices=["cuda:0", "cuda:1"] if two else
                ["cuda:0"], chunks=4, schedule="1f1b" if two else "gpipe")
    for _ in range(2):  # the first warms
        pipe.step(torch.randn(8, 8), torch.randn(8, 8), nn.MSELoss())
    timeline = pipe.last_timeline()
    forwards = [e for e in timeline.events if e.action.stage == 0 and str(e.action.op) == "F"]
    assert len(forwards) == 4
    for e in forwards:
        assert e.duration == pytest.approx(spin, rel=0.10), (e, spin)
    for r in range(timeline.num_ranks):
        lane = timeline.lane(r)
        assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(lane))
    assert timeline.makespan >= 4 * spin * 0.9
