"""Functions run on spawned gloo ranks by tests/pipeline/test_distributed.py (importable by
child processes, so they live in a module of their own)."""

from __future__ import annotations

import copy
import os
import signal
import time
from typing import Any

import torch
from torch import nn

from pipeline import Pipe, PipelineError
from pipeline.comm.channels import LinkChannel

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, summation order only (see tests/test_transparency.py)
# Pipe(timeout=...) of the failure tests: a failure that only the timeout ended would take this
# long; tests/pipeline/test_distributed.py requires far less (it is never waited for).
FAILURE_TIMEOUT = 300.0


def _model(seed: int = 0, width: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(),
                         nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 3))


def _local_grads_match(pipe: Pipe, reference: nn.Module, what: str) -> None:
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), ref[name].grad, **TOL,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


def equivalence(rank: int, combos: list[tuple[str, str]], balance_by_schedule: dict[str, list[int]],
                batches: tuple[int, ...] = (10, 7), devices: list[str] | None = None) -> int:
    """Every (schedule, checkpoint) combo: steps with different batch sizes (uneven chunks),
    loss on every rank and each rank's gradients equal the single-device model's."""
    checked = 0
    for schedule, checkpoint in combos:
        model = _model()
        reference = copy.deepcopy(model)
        pipe = Pipe(model, balance_by_schedule[schedule], chunks=4, schedule=schedule,
                    checkpoint=checkpoint, devices=devices)
        # 10, 7: 3,3,2,2 then 2,2,2,1 rows per micro-batch; (10, 7, 10, 12) goes back, then
        # even: shapes change for some messages of a step, while later receives are posted.
        for rows in batches:
            torch.manual_seed(rows)
            x, y = torch.randn(rows, 6), torch.randn(rows, 3)
            pipe.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            first, last = 0 in pipe.local_stages, len(pipe.balance) - 1 in pipe.local_stages
            loss = pipe.step(x if first else None, y if last else None, nn.MSELoss())
            expected = nn.MSELoss()(reference(x), y)
            expected.backward()  # (2BW's first step, too, runs at the initial weights)
            torch.testing.assert_close(loss.cpu(), expected.detach(), **TOL)
            _local_grads_match(pipe, reference, f"{schedule}/{checkpoint}/rows={rows}")
            checked += 1
    return checked


def synthesised(rank: int) -> tuple[str, list[str]]:
    """Each rank synthesises `auto` for the same unequal costs itself (so the ranks must build
    the same schedule), then trains it under two recomputation modes, exactly; returns the
    candidate chosen and this rank's actions."""
    from schedules import Costs
    from schedules.auto import search

    costs = Costs(forward=[1, 1], backward_input=[1, 3], backward_weight=[3, 1],
                  backward=[4, 4], comm=0.5)
    found = search(2, 4, costs, memory_limit=3)
    s = found.schedule
    equivalence(rank, [(s, "never"), (s, "always")], {s: [4, 4]})
    return found.chosen, [str(a) for a in s.actions[rank]]


def integer_inputs(rank: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    ids, y = torch.randint(0, 30, (6, 4)), torch.randn(6, 4, 2)
    pipe = Pipe(model, [2, 2], chunks=3, schedule="1f1b")
    loss = pipe.step(ids, y, nn.MSELoss())
    expected = nn.MSELoss()(reference(ids), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    _local_grads_match(pipe, reference, "embedding")
    return float(loss)


def two_bw_many(rank: int) -> list[float]:
    """step_many under 2bw across processes follows W(t+1) = W(t) - lr * grad f(W(t-1))."""
    model = _model()
    previous, current = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(5)
    data = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(3)]
    expected = []
    for x, y in data:
        stale = copy.deepcopy(previous)
        loss = nn.MSELoss()(stale(x), y)
        loss.backward()
        expected.append(loss.item())
        previous = copy.deepcopy(current)
        with torch.no_grad():
            for p, q in zip(current.parameters(), stale.parameters(), strict=True):
                p.sub_(0.5 * q.grad)
    pipe = Pipe(model, [2, 2, 4], chunks=2, schedule="2bw")
    losses = pipe.step_many(data, nn.MSELoss(), torch.optim.SGD(pipe.parameters(), lr=0.5))
    got = [v.item() for v in losses]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, expected, strict=True)), (
        got, expected)
    ref = dict(current.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref[name], **TOL)
    return got


class _Fail(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:  # the last, smallest micro-batch
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("bad micro-batch")
        return x


def failing_middle(rank: int, how: str) -> tuple[str, float]:
    """Rank 1 of 3 fails on micro-batch 3; returns the error each surviving rank raised."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _Fail(how), nn.Linear(4, 4))
    pipe = Pipe(model, [1, 2, 1], chunks=4, schedule="1f1b", timeout=FAILURE_TIMEOUT)
    start = time.monotonic()
    try:
        pipe.step(torch.randn(7, 4), torch.randn(7, 4), nn.MSELoss())
    except PipelineError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def meta_and_checkpoint(rank: int) -> Any:
    """Build on the meta device (no rank holds the whole model), load a state_dict, run, and
    gather the full state_dict on rank 0."""
    reference = _model(seed=3)
    with torch.device("meta"):
        skeleton = _model()
    pipe = Pipe(skeleton, [3, 2, 3], chunks=2)
    assert all(not p.is_meta for p in pipe.parameters())
    own = sum(p.numel() for p in pipe.parameters())
    assert own < sum(p.numel() for p in reference.parameters())  # only this rank's layers
    pipe.load_state_dict(reference.state_dict())
    torch.manual_seed(42)  # initialisers drew different numbers on each rank
    x = torch.randn(5, 6)
    out = pipe(x)
    if len(pipe.balance) - 1 in pipe.local_stages:
        torch.testing.assert_close(out, reference(x), **TOL)  # 2 chunks vs 1 batch: ulps
    else:
        assert out is None
    full = pipe.full_state_dict(dst=0)
    if rank == 0:
        assert full is not None and list(full) == list(reference.state_dict())
        fresh = _model(seed=9)
        fresh.load_state_dict(full)
        torch.testing.assert_close(fresh(x), reference(x), rtol=0, atol=0)
    return sorted(pipe.state_dict())


def one_message_per_transfer(rank: int) -> tuple[int, int]:
    """(messages sent, SEND actions + result messages) on this rank in a step whose shapes
    were already agreed by an earlier step (over a same-host link or the process group)."""
    model = _model()
    pipe = Pipe(model, [4, 4], chunks=4, schedule="1f1b")
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    args = (x if rank == 0 else None, y if rank == 1 else None, nn.MSELoss())
    pipe.step(*args)  # first step: shapes travel once
    transport = pipe._executor.transport
    calls: list[object] = []
    links = [c.link for c in transport._channels.values() if isinstance(c, LinkChannel)]
    real_isend = torch.distributed.isend

    def count(real: Any) -> Any:
        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return real(*args, **kwargs)
        return counting

    for link in links:  # one sendmsg per message: header and tensors together
        link.send = count(link.send)
    torch.distributed.isend = count(real_isend)
    try:
        pipe.step(*args)
    finally:
        torch.distributed.isend = real_isend
        for link in links:
            del link.send
    sends = sum(not a.is_compute and a.op.value.startswith("SEND")
                for a in pipe._programs.schedule(4, 1).actions[rank])
    results = 1 if rank == 1 else 0  # the last stage shares the loss with rank 0
    return len(calls), sends + results


def subgroup_pipelines(rank: int, members: list[list[int]]) -> float:
    """Two pipelines of two ranks each on four processes; each trains on its own subgroup
    and must match the single-device model."""
    import torch.distributed as dist

    groups = [dist.new_group(m) for m in members]  # every process creates every group
    mine = next(g for g, m in zip(groups, members, strict=True) if rank in m)
    model = _model(seed=len(members[0]) + members[0][0])
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [4, 4], chunks=3, schedule="1f1b", group=mine)
    torch.manual_seed(5)
    x, y = torch.randn(9, 6), torch.randn(9, 3)
    first = 0 in pipe.local_stages
    loss = pipe.step(x if first else None, None if first else y, nn.MSELoss())
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    _local_grads_match(pipe, reference, f"group {members}")
    return float(loss)


class Pack(nn.Module):
    """Returns its input wrapped in a 1-tuple."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x,)


class Unpack(nn.Module):
    """Takes a 1-tuple and doubles its element; a bare tensor here would be indexed by row."""

    def forward(self, t: tuple[torch.Tensor]) -> torch.Tensor:
        assert isinstance(t, tuple), f"expected a 1-tuple, got {type(t).__name__}"
        return t[0] * 2


def structure_and_input_grads(rank: int) -> bool:
    """A 1-tuple crosses the process boundary as a 1-tuple, and the input's gradient reaches
    `x.grad` on the rank that holds the input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Pack(), Unpack(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [2, 2], chunks=3, schedule="1f1b")
    x = torch.randn(6, 4, requires_grad=True)
    y = torch.randn(6, 2)
    x_ref = x.detach().clone().requires_grad_()
    pipe.step(x if rank == 0 else None, y if rank == 1 else None, nn.MSELoss())
    nn.MSELoss()(reference(x_ref), y).backward()
    _local_grads_match(pipe, reference, "structure")
    if rank == 0:
        assert x.grad is not None, "the input's gradient was not filled"
        torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    out = pipe(x.detach() if rank == 0 else None)
    if rank == 1:
        torch.testing.assert_close(out, reference(x).detach(), **TOL)
    return True


def scaler_overflow(rank: int) -> tuple[bool, float]:
    """Only the last rank's gradients overflow; every rank's GradScaler must skip the step and
    back off alike. Returns (weights unchanged, new scale)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[2].weight.register_hook(lambda g: g * float("inf"))
    pipe = Pipe(model, [2, 1], chunks=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipe.step(x, y, nn.MSELoss(), scaler=scaler)
    scaler.step(optimizer)
    scaler.update()
    same = all(torch.equal(p, b) for p, b in zip(pipe.parameters(), before, strict=True))
    return same, scaler.get_scale()


def resume(rank: int, schedule: str) -> bool:
    """Each rank saves its own training state mid-run; a fresh Pipe that loads it continues
    bit-identically to the run that never stopped."""
    def fresh(seed: int) -> tuple[Pipe, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.3), nn.Tanh(), nn.Linear(12, 3))
        pipe = Pipe(model, [2, 2], chunks=2, schedule=schedule, checkpoint="always")
        return pipe, torch.optim.Adam(pipe.parameters(), lr=0.01)

    def train(pipe: Pipe, opt: torch.optim.Optimizer, batches: list[Any]) -> None:
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            pipe.step(x, y, nn.MSELoss())
            opt.step()

    torch.manual_seed(42)
    batches = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(4)]
    pipe, opt = fresh(0)
    train(pipe, opt, batches)
    expected = [p.detach().clone() for p in pipe.parameters()]
    pipe, opt = fresh(0)
    train(pipe, opt, batches[:2])
    saved = copy.deepcopy({"pipe": pipe.training_state(), "optimizer": opt.state_dict()})
    pipe, opt = fresh(5)
    pipe.load_training_state(saved["pipe"])
    opt.load_state_dict(saved["optimizer"])
    train(pipe, opt, batches[2:])
    return all(torch.equal(p, e) for p, e in zip(pipe.parameters(), expected, strict=True))


def _exited(pid: int) -> bool:
    """Whether process `pid` has exited (on Linux, also while its parent has yet to reap it)."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] == "Z"  # a zombie: it has exited
        except FileNotFoundError:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_exited(pid: int, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not _exited(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not exit within {seconds:g} s")
        time.sleep(0.02)


def _pids() -> list[int]:
    """Every rank's process id, by rank (a collective: every rank calls it)."""
    import torch.distributed as dist

    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return pids


def dies_between_steps(rank: int, steps_before: int) -> tuple[str, float]:
    """Rank 1 of 3 exits after `steps_before` steps (0: before the first); the survivors'
    next step must raise PipelineError naming it, never a raw backend error."""
    pids = _pids()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = Pipe(model, [1, 2, 1], chunks=2, schedule="1f1b", timeout=FAILURE_TIMEOUT)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(steps_before):
        pipe.step(x, y, nn.MSELoss())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_exited(pids[1])  # the case is a peer already gone (its connections closed)
    start = time.monotonic()
    try:
        pipe.step(x, y, nn.MSELoss())
    except PipelineError as exc:
        return f"PipelineError: {exc}", time.monotonic() - start
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "no error", time.monotonic() - start


class _HearsFirst(nn.Module):
    """Rank 0's layer. Its second forward waits, polling the failure reports as every wait of
    the transport does, until this rank hears of the failure: rank 0 then exits before it sends
    micro-batch 1, which rank 1 is blocked receiving."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.transport: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                self.transport.check_failed()  # raises once rank 2's report is in the store
                time.sleep(0.01)
            raise AssertionError("rank 0 never heard of the failure")
        return x


def first_failure_after_rank0_exits(rank: int) -> str:
    """Rank 2 fails at once; rank 0 exits as soon as it hears; rank 1, blocked receiving from
    rank 0, hears only after that (when rank 0's connection breaks). Every rank that reports
    must name rank 2, the first failure, not rank 0."""
    hears = _HearsFirst()
    model = nn.Sequential(hears, nn.Linear(4, 4), _Fail("raise"))
    pipe = Pipe(model, [1, 1, 1], chunks=4, schedule="gpipe", timeout=FAILURE_TIMEOUT)
    hears.transport = pipe._executor.transport
    try:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
    except PipelineError as exc:
        if rank == 0:
            os._exit(0)  # it once hosted the store, which its exit took down
        return str(exc)
    return "no error"


def disagreeing_ranks(rank: int, field: str) -> str:
    """Two ranks built or called differently in `field`; returns what each raised."""
    from pipeline import PipeConfigError

    model = _model()
    balance = [[2, 6], [6, 2]][rank] if field == "balance" else [4, 4]
    schedule = ["gpipe", "1f1b"][rank] if field == "schedule" else "1f1b"
    rows = [8, 6][rank] if field == "batch rows" else 8
    pipe = Pipe(model, balance, chunks=2, schedule=schedule, timeout=FAILURE_TIMEOUT)
    x, y = torch.randn(rows, 6), torch.randn(rows, 3)
    start = time.monotonic()
    try:
        pipe.step(x, y, nn.MSELoss())
    except PipeConfigError as exc:
        assert time.monotonic() - start < FAILURE_TIMEOUT / 3  # found, not timed out
        return f"PipeConfigError: {exc}"
    except PipelineError as exc:
        return f"PipelineError: {exc}"
    return "no error"


def profiled_balance(rank: int, method: str) -> list[int]:
    """Each rank's profiler sees different costs (as timings do); all must end with rank 0's
    balance. Only rank 0 is given a sample: the others do not profile."""
    from pipeline.splitting import config as pipe_module

    costs = [[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0], [9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
    name = "layer_times" if method == "time" else "layer_sizes"
    setattr(pipe_module, name, lambda model, sample: costs[rank])
    pipe = Pipe(_model(), method, stages=2, sample=torch.randn(4, 6) if rank == 0 else None)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    pipe.step(x, y, nn.MSELoss())  # and they agree (the fingerprint compares balances)
    return list(pipe.balance)


def tied_language_model(rank: int, combos: list[tuple[str, str, list[int]]]) -> int:
    """A language model whose head shares the embedding's weight across the first and last
    stage: three AdamW steps with global clipping equal the plain model's, on every rank."""
    from tests.models import lm_loss, tiny_lm
    from tests.pipeline.parallel.test_ties import _batch

    checked = 0
    for i, (schedule, checkpoint, balance) in enumerate(combos):
        reference = tiny_lm(dropout=0.0)
        if i == 0:  # no rank holds the whole model; the copy is filled from its owner
            with torch.device("meta"):
                model = tiny_lm(dropout=0.0)
            pipe = Pipe(model, balance, chunks=3, schedule=schedule, checkpoint=checkpoint,
                        param_init="skip")
            pipe.load_state_dict(reference.state_dict())
        else:
            model = tiny_lm(dropout=0.0)
            pipe = Pipe(model, balance, chunks=3, schedule=schedule, checkpoint=checkpoint)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        plain_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for t in range(3):
            x, y = _batch(t)
            optimizer.zero_grad()
            plain_opt.zero_grad()
            loss = pipe.step(x, y, lm_loss)
            norm = pipe.clip_grad_norm_(0.5)
            expected = lm_loss(reference(x), y)
            expected.backward()
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            torch.testing.assert_close(loss, expected.detach(), **TOL)
            torch.testing.assert_close(norm, want, **TOL)
            optimizer.step()
            plain_opt.step()
        full = pipe.full_state_dict()
        if rank == 0:
            assert full is not None
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-5,
                                           msg=f"{schedule}/{checkpoint}: {key}")
        # A copy held here takes its owner's value when it next runs.
        for key, value in pipe.state_dict().items():
            torch.testing.assert_close(value, reference.state_dict()[key], rtol=1e-5,
                                       atol=1e-5, msg=f"{schedule}/{checkpoint}: {key}")
        checked += 1
    return checked


def target_rows_differ_later(rank: int) -> str:
    """After steps with 8 rows, the last stage's rank passes a 6-row target: it must refuse
    (the configuration agreement ran at the first step only), and rank 0 hears of it."""
    pipe = Pipe(_model(), [4, 4], chunks=2, timeout=60)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe.step(x, y, nn.MSELoss())
    try:
        pipe.step(None if rank == 1 else x, y[:6] if rank == 1 else y, nn.MSELoss())
    except PipelineError as exc:
        return str(exc)
    return "no error"


def batch_norm_statistics(rank: int, deferred: bool) -> int:
    """BatchNorm across processes under recomputation: each rank's running statistics as one
    device leaves them (per micro-batch, or deferred: once per batch)."""
    from tests.models import small_cnn
    from tests.pipeline.test_real_models import _deferred_reference

    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    reference = small_cnn()
    pipe = Pipe(small_cnn(), [5, 7], chunks=4, checkpoint="always", deferred_batch_norm=deferred)
    pipe.step(x, y, nn.CrossEntropyLoss())
    if deferred:
        _deferred_reference(reference, [x], 4)
    else:
        for part in x.chunk(4):
            reference(part)
    want = reference.state_dict()
    checked = 0
    for key, got in pipe.state_dict().items():
        if "running" in key or "num_batches" in key:
            torch.testing.assert_close(got, want[key], rtol=1e-5, atol=1e-6, msg=key)
            checked += 1
    return checked


def released_outputs(rank: int, schedule: str) -> tuple[int, int]:
    """Stage outputs sent to the next process are freed after the send (their graph stays);
    the gradients are still exactly one device's. Returns the bytes released, and how many
    more activation bytes than stashed bytes the rank held at its peak (outputs kept)."""
    model, reference = _model(), _model()
    pipe = Pipe(model, [3, 5], chunks=2, schedule=schedule, checkpoint="never")
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe.track_memory = True
    pipe.step(x, y, nn.MSELoss())
    nn.MSELoss()(reference(x), y).backward()
    _local_grads_match(pipe, reference, schedule)
    stats = pipe.memory_stats()[0]
    return (stats["released_output_bytes"],
            stats["peak_activation_bytes"] - stats["peak_stashed_bytes"])


def linked_peers(rank: int) -> list[int]:
    """The group ranks this rank's pipeline reaches over a same-host link."""
    pipe = Pipe(_model(), [3, 3, 2], chunks=2)
    return pipe._executor.transport.linked()


def unusable_after_failure(rank: int) -> list[str]:
    """A tied language model fails its second step on the last rank, after rank 0 sent every
    activation of it; then every later call on every rank must refuse with PipelineError.
    Before, the next step's tie sync read a stale activation: a raw AssertionError."""
    from tests.models import lm_loss, tiny_lm
    from tests.pipeline.parallel.test_ties import _batch

    pipe = Pipe(tiny_lm(dropout=0.0), [3, 4], chunks=4, schedule="gpipe", timeout=30)
    x, y = _batch(0, rows=8)
    pipe.step(x, y, lm_loss)

    def bad_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad loss")

    try:
        pipe.step(x, y, bad_loss)
        return ["the failing step did not fail"]
    except PipelineError:
        pass
    seen = []
    for call in (lambda: pipe.step(x, y, lm_loss), lambda: pipe(x),
                 lambda: pipe.clip_grad_norm_(1.0), lambda: pipe.full_state_dict()):
        try:
            call()
            seen.append("no error")
        except Exception as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen
