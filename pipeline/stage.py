"""The stage runtime: one rank executes its action list, whatever schedule produced it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from pipeline.checkpoint import RngReplay, recomputing, stage_seed
from pipeline.memory import SavedBytes
from pipeline.microbatch import as_tuple
from pipeline.split_backward import WeightGrad, backward_input, backward_weight
from pipeline.transport import Transport, move
from schedules import Action, Event, Op

__all__ = ["LossFn", "StageRuntime", "StepContext"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class StepContext:
    """Everything one step shares between ranks (read-only for them, except the outputs)."""

    inputs: Sequence[tuple[Any, ...]]  # micro-batches for the first stage
    targets: Sequence[Any] | None  # per micro-batch, for the loss on the last stage
    loss_fn: LossFn | None  # None: forward only
    loss_weights: Sequence[float]  # micro-batch rows / batch rows: mean of means is the mean
    checkpointed: Sequence[bool]  # per micro-batch
    seed: int
    t0: float = field(default_factory=time.perf_counter)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    # 2BW: (stage, version) -> {parameter name: tensor}; guarded by `update_lock`.
    versions: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    optimizer: Any = None
    num_versions_kept: int = 0  # after the step, keep version n: the next step's "previous"
    update_lock: threading.Lock = field(default_factory=threading.Lock)
    track_memory: bool = False


@dataclass
class _Stash:
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...] | None  # None while checkpointed (only the inputs are kept)
    loss: torch.Tensor | None = None
    weight_grad: WeightGrad | None = None


class StageRuntime:
    """Holds one rank's stages and runs its actions: F, B, I, W and U (2BW updates).

    It never looks at which schedule it is running: the actions say everything.
    """

    def __init__(self, rank: int, stages: dict[int, nn.Module], device: torch.device,
                 num_stages: int, rank_of: Callable[[int], int], transport: Transport) -> None:
        self.rank = rank
        self.stages = stages
        self.device = device
        self.num_stages = num_stages
        self.rank_of = rank_of
        self.transport = transport
        self.rng = RngReplay(device)
        self.events: list[Event] = []
        self.peak_stashed = 0
        self.stashed_bytes = 0
        self.peak_stashed_bytes = 0
        self._stash: dict[tuple[int, int], _Stash] = {}
        self._bytes: dict[tuple[int, int], int] = {}  # what each stash entry holds
        self.current: Action | None = None  # for error reports
        self._ready = 0.0  # when the current action had its inputs

    # -- driving ------------------------------------------------------------------------------
    def run(self, actions: Sequence[Action], ctx: StepContext) -> None:
        self.events = []
        self.peak_stashed = self.stashed_bytes = self.peak_stashed_bytes = 0
        self._stash.clear()
        self._bytes.clear()
        handlers = {Op.F: self._forward, Op.B: self._backward, Op.I: self._backward,
                    Op.W: self._weight, Op.U: self._update}
        for action in actions:
            handler = handlers.get(action.op)
            if handler is None:
                continue  # SEND/RECV of a lowered schedule: the transport does them
            self.current = action
            self._ready = time.perf_counter()
            handler(action, ctx)
            # Compute time only: waiting for a peer's data is idle time (a bubble), so the
            # clock starts when the handler has its inputs (see _received).
            self.events.append(Event(self.rank, action, self._ready - ctx.t0,
                                     time.perf_counter() - ctx.t0))
        if self._stash:  # internal invariant: a validated schedule frees everything it stashed
            raise AssertionError(f"rank {self.rank}: left stashed {sorted(self._stash)}")

    def _received(self) -> None:
        self._ready = time.perf_counter()

    # -- forward ------------------------------------------------------------------------------
    def _call(self, action: Action, inputs: tuple[Any, ...], ctx: StepContext) -> tuple[Any, ...]:
        module = self.stages[action.stage]
        # As in nn.Sequential, a layer gets the previous output as one argument (a tuple stays
        # a tuple): transported tuples are unpacked for transport only.
        arg = inputs[0] if len(inputs) == 1 else inputs
        if action.version is None:
            def fn() -> Any:
                return module(arg)
        else:
            weights = ctx.versions[(action.stage, action.version)]

            def fn() -> Any:
                return functional_call(module, weights, (arg,))
        seed = stage_seed(ctx.seed, action.stage, action.microbatch)
        return as_tuple(self.rng.run((action.stage, module.training), seed, fn))

    def _forward(self, action: Action, ctx: StepContext) -> None:
        s, m = action.stage, action.microbatch
        if s == 0:
            inputs = move(ctx.inputs[m], self.device)
        else:
            inputs = self.transport.recv("F", s, m, self.rank_of(s - 1), self.device)
            self._received()
        train = ctx.loss_fn is not None
        keep_graph = train and not ctx.checkpointed[m]
        saved = SavedBytes()
        with torch.set_grad_enabled(keep_graph):
            if ctx.track_memory and keep_graph:
                with saved:
                    outputs = self._call(action, inputs, ctx)
            else:
                outputs = self._call(action, inputs, ctx)
        last = s == self.num_stages - 1
        if not train:
            if last:
                ctx.outputs[m] = tuple(o.detach() if isinstance(o, torch.Tensor) else o
                                       for o in outputs)
            else:
                self.transport.send("F", s + 1, m, outputs, self.rank_of(s + 1))
            return
        loss = None
        if last:
            loss = self._loss(outputs, m, ctx)
            ctx.losses[m] = loss.detach()
        elif keep_graph:
            self.transport.send("F", s + 1, m, outputs, self.rank_of(s + 1))
        else:
            # Run without a graph, nothing requires grad; the replay will. Mark floating
            # outputs so the next stage still computes (and returns) their gradients.
            marked = tuple(o.detach().requires_grad_(True) if isinstance(o, torch.Tensor)
                           and o.is_floating_point() else o for o in outputs)
            self.transport.send("F", s + 1, m, marked, self.rank_of(s + 1))
        input_bytes = sum(t.numel() * t.element_size() for t in inputs
                          if isinstance(t, torch.Tensor))
        self._stash[(s, m)] = _Stash(inputs, outputs if keep_graph else None, loss)
        self.peak_stashed = max(self.peak_stashed, len(self._stash))
        self.stashed_bytes += input_bytes + saved.bytes
        self.peak_stashed_bytes = max(self.peak_stashed_bytes, self.stashed_bytes)
        self._bytes[(s, m)] = input_bytes + saved.bytes

    def _loss(self, outputs: tuple[Any, ...], m: int, ctx: StepContext) -> torch.Tensor:
        assert ctx.loss_fn is not None and ctx.targets is not None
        out = outputs[0] if len(outputs) == 1 else outputs
        loss = ctx.loss_fn(out, ctx.targets[m])
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(
                f"loss_fn must return a 0-dim tensor (a mean over the micro-batch); got "
                f"{type(loss).__name__} with shape {getattr(loss, 'shape', None)}"
            )
        return loss * ctx.loss_weights[m]

    # -- backward -----------------------------------------------------------------------------
    def _recompute(self, action: Action, stash: _Stash, ctx: StepContext) -> None:
        with torch.enable_grad(), recomputing():
            stash.outputs = self._call(action, stash.inputs, ctx)
        if action.stage == self.num_stages - 1:
            stash.loss = self._loss(stash.outputs, action.microbatch, ctx)

    def _backward(self, action: Action, ctx: StepContext) -> None:
        s, m = action.stage, action.microbatch
        stash = self._stash[(s, m)]
        if stash.outputs is None:
            self._recompute(action, stash, ctx)
        assert stash.outputs is not None
        if s == self.num_stages - 1:
            assert stash.loss is not None
            roots: list[torch.Tensor] = [stash.loss]
            grads: list[torch.Tensor] = [torch.ones_like(stash.loss)]
        else:
            incoming = self.transport.recv("B", s, m, self.rank_of(s + 1), self.device)
            self._received()
            pairs = [(o, g) for o, g in zip(stash.outputs, incoming, strict=True)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            roots, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if action.op is Op.B:
            if roots:
                torch.autograd.backward(roots, grads)
            input_grads = [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None
                           for t in stash.inputs]
            self._free(s, m)
        else:  # I: input gradients now, weight gradients at this micro-batch's W
            params = self._params(action, ctx)
            input_grads, stash.weight_grad = backward_input(roots, grads, stash.inputs, params)
        if s > 0:
            self.transport.send("B", s - 1, m, tuple(input_grads), self.rank_of(s - 1))

    def _params(self, action: Action, ctx: StepContext) -> list[torch.Tensor]:
        if action.version is None:
            return list(self.stages[action.stage].parameters())
        return list(ctx.versions[(action.stage, action.version)].values())

    def _weight(self, action: Action, ctx: StepContext) -> None:
        del ctx
        stash = self._stash[(action.stage, action.microbatch)]
        assert stash.weight_grad is not None, f"{action} before its I"
        backward_weight(stash.weight_grad)
        self._free(action.stage, action.microbatch)

    def _free(self, s: int, m: int) -> None:
        del self._stash[(s, m)]
        self.stashed_bytes -= self._bytes.pop((s, m))

    # -- 2BW weight update ----------------------------------------------------------------------
    def _update(self, action: Action, ctx: StepContext) -> None:
        """U(s, b): batch b's gradients (computed at version b) update the live weights.

        The live parameters hold version b + 1. Their gradient becomes batch b's; the optimizer,
        if the step owns one, makes version b + 2 in place, and a copy of it is kept while a
        later batch (or the next step) computes with it. Version b is dropped: its backward
        passes are all done.
        """
        s, b = action.stage, action.microbatch
        module = self.stages[s]
        used = ctx.versions[(s, b)]
        with ctx.update_lock:
            for name, p in module.named_parameters():
                g = used[name].grad
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.to(p.device)
                else:
                    p.grad.add_(g)
            if ctx.optimizer is not None:
                ctx.optimizer.step()
                for p in module.parameters():
                    p.grad = None
            if b + 2 <= ctx.num_versions_kept:
                ctx.versions[(s, b + 2)] = {
                    name: p.detach().clone().requires_grad_(p.requires_grad)
                    for name, p in module.named_parameters()
                }
            del ctx.versions[(s, b)]
