"""Defects real models found: eval mode and dropout replay, BatchNorm under recomputation,
meta-device layers without initialisers, targets that disagree with the output."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from pipeline import Pipe, PipeConfigError
from pipeline.errors import PipeTypeError
from tests.models import small_cnn

CHECKPOINTS = ["never", "except_last", "always"]


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.GELU(), nn.Linear(16, 16),
                         nn.Dropout(0.5), nn.Linear(16, 3))


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_replays_draw_the_forwards_masks_after_eval_and_train(checkpoint: str) -> None:
    """`pipe.eval(); pipe(x); pipe.train()` once made the next step's replays draw other masks
    than their forwards (the "does this forward draw" cache was keyed on a flag eval never
    switched): the gradients differed from the no-recompute run and from the same seed's."""
    x, y = torch.randn(12, 6), torch.randn(12, 3)
    runs = {}
    for name, mode, detour in (("plain", "never", False), ("fresh", checkpoint, False),
                               ("after eval", checkpoint, True)):
        model = _dropout_mlp()
        pipe = Pipe(model, balance=[3, 3], devices=["cpu", "cpu"], chunks=4, checkpoint=mode)
        if detour:
            pipe.eval()
            pipe(x)
            pipe.train()
        torch.manual_seed(7)
        pipe.step(x, y, nn.MSELoss())
        runs[name] = _grads(model)
        pipe.close()
    for name in ("fresh", "after eval"):
        for key, g in runs["plain"].items():
            torch.testing.assert_close(runs[name][key], g, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}: {key}")


def _sequential_microbatch_bn(model: nn.Sequential, x: torch.Tensor, chunks: int) -> None:
    """What a plain loop over the micro-batches leaves in the running statistics."""
    for part in x.chunk(chunks):
        model(part)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_recomputation_leaves_batchnorm_statistics_as_the_forward_did(checkpoint: str) -> None:
    """A replayed forward once updated the running statistics a second time:
    `num_batches_tracked` was 7 or 8 after 4 micro-batches, not 4."""
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    reference = small_cnn()
    model = copy.deepcopy(reference)
    _sequential_microbatch_bn(reference, x, 4)
    pipe = Pipe(model, balance=[5, 7], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    pipe.step(x, y, nn.CrossEntropyLoss())
    for (key, got), want in zip(model.state_dict().items(), reference.state_dict().values(),
                                strict=True):
        if "running" in key or "num_batches" in key:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
    pipe.close()


class _Scale(nn.Module):
    """A custom layer without reset_parameters (as transformers' Conv1D)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _Wrapper(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = _Scale(width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.inner(x))
        return out


def _meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4), nn.GELU(), _Wrapper(4), nn.Linear(4, 2))


def test_a_meta_layer_without_an_initialiser_is_refused_naming_it() -> None:
    """Such a layer was once materialised as uninitialised memory, silently."""
    with pytest.raises(PipeConfigError, match=r"layer '2.inner' \(_Scale\) was built on the "
                                              r"meta device and has no reset_parameters"):
        Pipe(_meta_model(), balance=[2, 2], devices=["cpu", "cpu"])


def test_param_init_initialises_meta_layers_as_the_model_does() -> None:
    def init(module: nn.Module) -> None:  # GPT-2's: normal(0, 0.02) weights, zero biases
        for name, p in module.named_parameters(recurse=False):
            if name == "bias" or isinstance(module, nn.LayerNorm):
                nn.init.zeros_(p) if name == "bias" else nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    model = _meta_model()
    pipe = Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], param_init=init)
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    assert torch.isfinite(pipe(x)).all()
    for name, p in pipe.named_parameters():
        assert not p.is_meta
        if name.endswith("bias") or name.startswith("2.norm"):
            assert torch.all(p == (1.0 if name == "2.norm.weight" else 0.0)), name
        else:
            assert 0 < p.std().item() < 0.05, name  # 0.02, not the layers' defaults
    pipe.close()


def test_param_init_skip_leaves_the_tensors_to_a_load() -> None:
    torch.manual_seed(1)
    reference = nn.Sequential(nn.Linear(4, 4), nn.GELU(), _Wrapper(4), nn.Linear(4, 2))
    nn.init.normal_(reference[2].inner.weight)
    pipe = Pipe(_meta_model(), balance=[2, 2], devices=["cpu", "cpu"], param_init="skip")
    pipe.load_state_dict(reference.state_dict())
    x = torch.randn(6, 4)
    torch.testing.assert_close(pipe(x), reference(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(PipeConfigError, match="param_init must be one of"):
        Pipe(_meta_model(), balance=[2, 2], param_init="zeros")
    pipe.close()


def _deferred_reference(model: nn.Sequential, batches: list[torch.Tensor], chunks: int) -> None:
    """What deferred BatchNorm promises, computed independently on one device: each batch runs
    micro-batch by micro-batch (each normalised by its own statistics), and each BatchNorm's
    running statistics then move once, by torch.var_mean of every row that layer saw."""
    layers = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for batch in batches:
        seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
        saved = [(m.running_mean.clone(), m.running_var.clone()) for m in layers]
        hooks = [m.register_forward_pre_hook(
            lambda _m, args, into=seen[i]: into.append(args[0].detach()))
            for i, m in enumerate(layers)]
        for part in batch.chunk(chunks):
            model(part)
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for i, m in enumerate(layers):
                rows = torch.cat(seen[i]).transpose(0, 1).flatten(1)
                var, mean = torch.var_mean(rows, dim=1, unbiased=True)
                m.running_mean.copy_(saved[i][0] * (1 - m.momentum) + m.momentum * mean)
                m.running_var.copy_(saved[i][1] * (1 - m.momentum) + m.momentum * var)
                m.num_batches_tracked.sub_(chunks - 1)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_deferred_batch_norm_commits_the_batch_statistics_once(checkpoint: str,
                                                               schedule: str) -> None:
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    batches = [x, 2 * x + 1]  # statistics that differ between the two steps
    reference, full = small_cnn(), small_cnn()
    model = copy.deepcopy(reference)
    pipe = Pipe(model, balance=[5, 7], devices=["cpu", "cpu"], chunks=4, schedule=schedule,
                checkpoint=checkpoint, deferred_batch_norm=True)
    for batch in batches:
        pipe.step(batch, y, nn.CrossEntropyLoss())
        full(batch)  # one full-batch training forward
    _deferred_reference(reference, batches, 4)
    plain = reference.state_dict()
    for key, got in model.state_dict().items():
        if "running" in key or "num_batches" in key:
            # float64 sums of squares against torch.var_mean: rounding only.
            torch.testing.assert_close(got, plain[key], rtol=1e-5, atol=1e-6, msg=key)
    assert int(model[1].num_batches_tracked) == 2
    # The first BatchNorm sees the same rows as in a full-batch forward: the same statistics.
    for key in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(model.state_dict()[key], full.state_dict()[key], rtol=1e-5,
                                   atol=1e-6)
    pipe.close()


def test_deferred_batch_norm_with_cumulative_momentum_and_inference() -> None:
    x = torch.randn(12, 3, 4, 4)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
                              nn.Flatten(), nn.Linear(4 * 2 * 2, 2))
    model = copy.deepcopy(reference)
    pipe = Pipe(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=3,
                deferred_batch_norm=True)
    for k in range(3):
        reference(x + k)  # a cumulative average over the batches
        pipe(x + k)  # a training-mode forward updates the statistics, as model(x) does
    for key, got in model.state_dict().items():
        if "running" in key or "num_batches" in key:
            torch.testing.assert_close(got, reference.state_dict()[key], rtol=1e-5, atol=1e-6)
    pipe.close()


def _moves_its_statistics(model: nn.Sequential) -> bool:
    """A bare training forward updates every BatchNorm's running statistics."""
    layer = model[1]
    before = (layer.running_mean.clone(), int(layer.num_batches_tracked))
    model(torch.randn(8, 3, 8, 8) + 3)
    return (int(layer.num_batches_tracked) == before[1] + 1
            and not torch.equal(layer.running_mean, before[0]))


def test_deferred_batch_norm_leaves_no_hooks_after_close_or_collection() -> None:
    """Its hooks once stayed on the model: a bare model, or a later Pipe without deferral,
    never moved its running statistics again (`num_batches_tracked` stayed 0)."""
    model = small_cnn()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    pipe = Pipe(model, balance=[5, 7], devices=["cpu", "cpu"], chunks=2,
                deferred_batch_norm=True)
    pipe.step(x, y, nn.CrossEntropyLoss())
    pipe.close()
    assert _moves_its_statistics(model)
    Pipe(model, balance=[5, 7], devices=["cpu", "cpu"], chunks=2, deferred_batch_norm=True)
    gc.collect()  # the Pipe is gone without close()
    assert _moves_its_statistics(model)
    plain = Pipe(model, balance=[5, 7], devices=["cpu", "cpu"], chunks=2)
    tracked = int(model[1].num_batches_tracked)
    plain.step(x, y, nn.CrossEntropyLoss())
    assert int(model[1].num_batches_tracked) == tracked + 2  # once per micro-batch
    plain.close()


def test_deferred_batch_norm_takes_true_false_or_global() -> None:
    with pytest.raises(PipeConfigError, match=r"one of \(False, True, 'global'\) \(got 'sync'\)"):
        Pipe(small_cnn(), balance=[5, 7], deferred_batch_norm="sync")
    with pytest.raises(PipeTypeError, match="must be True, False or 'global' "
                                            r"\(got int 1\)"):
        Pipe(small_cnn(), balance=[5, 7], deferred_batch_norm=1)  # type: ignore[arg-type]
    # Without a "dp" dimension the global batch is the batch: "global" is True.
    model = small_cnn()
    pipe = Pipe(model, balance=[5, 7], devices=["cpu", "cpu"], chunks=2,
                deferred_batch_norm="global")
    pipe.step(torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,)), nn.CrossEntropyLoss())
    assert int(model[1].num_batches_tracked) == 1
    pipe.close()
