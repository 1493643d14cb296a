"""Functions run on spawned gloo ranks by tests/pipeline/parallel/test_data_parallel.py:
replicas that agree with one device and with DDP (unused parameters, buffers, ties, clipping,
zb-v, 2BW)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipeline import Pipe
from tests.pipeline.dist_workers import TOL
from tests.pipeline.dp_workers import _shard


def _mesh_2x2() -> tuple[Any, int]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    return mesh, mesh.get_local_rank("dp")


class _Gated(nn.Module):
    """Uses `rare` only for a batch with a flagged row (column 6), and never uses `unused`."""

    def __init__(self) -> None:
        super().__init__()
        self.rare = nn.Parameter(torch.randn(6))
        self.unused = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flag, x = x[:, 6:], x[:, :6]
        if bool((flag > 0).any()):
            x = x + flag * self.rare
        return x


class _Idle(nn.Module):
    """The identity, with a parameter nobody uses."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.idle = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _gated_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(_Gated(), nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(),
                         _Idle(16), nn.Linear(16, 3))


def _flagged_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """13 rows (dp rank 0 takes rows 0-6, rank 1 rows 7-12); one row is flagged: in dp rank
    0's first micro-batch at step 0, in dp rank 1's last one at step 1, none at step 2."""
    g = torch.Generator().manual_seed(step)
    x = torch.cat([torch.randn(13, 6, generator=g), torch.zeros(13, 1)], dim=1)
    if step < 2:
        x[[1, 12][step], 6] = 1.0
    return x, torch.randn(13, 3, generator=g)


def unused_parameters(rank: int) -> int:
    """A parameter no replica used keeps `.grad` None (so AdamW leaves it alone, as on one
    device); one used on a single replica gets the average with zeros for the others; three
    AdamW steps with weight decay equal one device's."""
    mesh, dp_rank = _mesh_2x2()
    reference, model = _gated_model(), _gated_model()
    pipe = Pipe(model, [3, 4], chunks=2, mesh=mesh)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    ref = dict(reference.named_parameters())
    checked = 0
    for step in range(3):
        x, y = _flagged_batch(step)
        optimizer.zero_grad()
        plain.zero_grad()
        pipe.step(_shard(x, dp_rank, 2), _shard(y, dp_rank, 2), nn.MSELoss())
        nn.MSELoss()(reference(x), y).backward()
        for name, p in pipe.named_parameters():
            if ref[name].grad is None:
                assert p.grad is None, f"step {step}: {name} has a gradient no replica made"
            else:
                torch.testing.assert_close(p.grad, ref[name].grad, **TOL,
                                           msg=lambda m, n=f"step {step}: {name}": f"{n}: {m}")
            checked += 1
        optimizer.step()
        plain.step()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return checked


# -- BatchNorm ------------------------------------------------------------------------------------
def _bn_layers(model: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()
            if "running" in k or "num_batches" in k}


def _micro_batch_grads(model: nn.Sequential, parts: list[tuple[torch.Tensor, torch.Tensor]],
                       rows: int) -> None:
    """The gradient a dp x pp pipeline computes with BatchNorm: each micro-batch normalised by
    its own statistics, the losses weighted by rows over the global batch (buffers untouched)."""
    saved = _buffers(model)
    for x, y in parts:
        (nn.CrossEntropyLoss()(model(x), y) * (len(x) / rows)).backward()
    model.load_state_dict(saved, strict=False)


def _per_micro_batch(model: nn.Sequential, parts: list[torch.Tensor]) -> None:
    """Running statistics as a plain loop over micro-batches moves them."""
    with torch.no_grad():
        for x in parts:
            model(x)


def batch_norm(rank: int) -> int:
    """BatchNorm under dp x pp = 2 x 2, each against one device over two SGD steps:
    buffers broadcast from dp rank 0 at construction; each step's buffers dp rank 0's (plain and
    deferred), on every replica and in `full_state_dict`; without broadcasting, each replica's
    own; deferred "global": the whole global batch's statistics on every replica."""
    from tests.models import small_cnn
    from tests.pipeline.test_real_models import _deferred_reference

    mesh, dp_rank = _mesh_2x2()
    chunks, rows = 2, 16
    checked = 0
    for deferred, broadcast in ((False, True), (False, False), (True, True), ("global", False)):
        what = f"deferred={deferred}, broadcast_buffers={broadcast}"
        reference, model = small_cnn(), small_cnn()
        if dp_rank == 1:  # replicas that start apart: construction makes them dp rank 0's
            for layer in _bn_layers(model):
                layer.running_mean.fill_(5.0)
                layer.num_batches_tracked.fill_(7)
        pipe = Pipe(model, [5, 7], chunks=chunks, mesh=mesh, deferred_batch_norm=deferred,
                    broadcast_buffers=broadcast)
        want = _buffers(reference)
        for key, value in _buffers(pipe).items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=0,
                                       msg=lambda m, k=f"{what}: construction: {key}": f"{k}: {m}")
        # SGD: a convolution's bias before BatchNorm has a gradient of zero up to rounding,
        # which Adam would turn into steps of lr * sign(rounding).
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        plain = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(rows, 3, 8, 8, generator=g) * (step + 1)
            y = torch.randint(0, 5, (rows,), generator=g)
            shards = list(zip(x.chunk(2), y.chunk(2), strict=True))
            optimizer.zero_grad()
            plain.zero_grad()
            pipe.step(*shards[dp_rank], nn.CrossEntropyLoss())
            parts = [(a, b) for sx, sy in shards
                     for a, b in zip(sx.chunk(chunks), sy.chunk(chunks), strict=True)]
            _micro_batch_grads(reference, parts, rows)
            # The statistics the replicas must hold after the step.
            seen = shards[0 if broadcast else dp_rank][0]
            if deferred == "global":
                _deferred_reference(reference, [x], 2 * chunks)
            elif deferred:
                _deferred_reference(reference, [seen], chunks)
            else:
                _per_micro_batch(reference, list(seen.chunk(chunks)))
            want = _buffers(reference)
            for key, value in _buffers(pipe).items():
                # float64 sums of squares against torch.var_mean: rounding only.
                torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=f"{what}: step {step}: {key}":
                                           f"{k}: {m}")
                checked += 1
            optimizer.step()
            plain.step()
        full = pipe.full_state_dict()
        if rank == 0:
            assert full is not None
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(full[key], value, **TOL,
                                           msg=lambda m, k=f"{what}: {key}": f"{k}: {m}")
        pipe.close()
    return checked


# -- ties, clipping, zb-v and 2BW under dp -----------------------------------------------------
def ties_and_clipping(rank: int) -> bool:
    """A language model whose head shares the embedding across the two stages, on 2 x 2: two
    accumulating `step` calls per optimizer step, global clipping, three AdamW steps, against
    one device."""
    from tests.models import lm_loss, tiny_lm
    from tests.pipeline.parallel.test_ties import _batch

    mesh, dp_rank = _mesh_2x2()
    checked = 0
    for schedule, balance in (("1f1b", [3, 4]), ("zb-v", [2, 2, 1, 2])):
        reference = tiny_lm(dropout=0.0)
        pipe = Pipe(tiny_lm(dropout=0.0), balance, chunks=2, schedule=schedule, mesh=mesh)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for t in range(3):
            optimizer.zero_grad()
            plain.zero_grad()
            for k in range(2):  # two batches accumulate before the update
                x, y = _batch(2 * t + k)
                loss = pipe.step(_shard(x, dp_rank, 2), _shard(y, dp_rank, 2), lm_loss)
                expected = lm_loss(reference(x), y)
                expected.backward()
                torch.testing.assert_close(loss, expected.detach(), **TOL)
            norm = pipe.clip_grad_norm_(0.5)
            want = nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            torch.testing.assert_close(norm, want, **TOL)
            ref = dict(reference.named_parameters())
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad, ref[name].grad, **TOL,
                                           msg=lambda m, n=f"{schedule} {t}: {name}": f"{n}: {m}")
                checked += 1
            optimizer.step()
            plain.step()
        full = pipe.full_state_dict()
        if rank == 0:
            assert full is not None
            for key, value in reference.state_dict().items():
                # As in tests/pipeline/parallel/test_ties.py: three AdamW steps, 1e-5 relative.
                torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, k=f"{schedule}: {key}": f"{k}: {m}")
        pipe.close()
    return bool(checked)


def zero_bubble_v_and_2bw(rank: int) -> int:
    """zb-v's gradients (two accumulating steps) and 2BW's stale update rule (`step` and
    `step_many`) on 2 x 2 equal one device's on the global batch."""
    from tests.pipeline.dist_workers import _model
    from tests.pipeline.dp_workers import _global_batch, equivalence
    from tests.pipeline.test_pipe import _two_bw_reference

    checked = equivalence(rank, 2, 2, [("zb-v", "always", [2, 2, 2, 2])])
    mesh, dp_rank = _mesh_2x2()
    data, lr = [_global_batch(t) for t in range(3)], 0.5
    final = _model()
    expected = _two_bw_reference(final, data, lr)  # leaves `final` at the last weights
    ref = dict(final.named_parameters())
    shards = [(_shard(x, dp_rank, 2), _shard(y, dp_rank, 2)) for x, y in data]
    for many in (False, True):
        model = _model()
        pipe = Pipe(model, [4, 4], chunks=2, schedule="2bw", mesh=mesh)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)
        if many:
            losses = [v.item() for v in pipe.step_many(shards, nn.MSELoss(), optimizer)]
        else:
            losses = []
            for x, y in shards:
                optimizer.zero_grad()
                losses.append(pipe.step(x, y, nn.MSELoss()).item())
                optimizer.step()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
        pipe.close()
        checked += 1
    return checked
