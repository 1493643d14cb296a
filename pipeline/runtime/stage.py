"""The stage runtime: one rank executes its lowered action list, whatever schedule produced it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.comm.transport import Transport, move
from pipeline.errors import PipeConfigError
from pipeline.runtime.gpu_clock import GpuClock
from pipeline.runtime.microbatch import from_tuple, leading_rows, like, sendable
from pipeline.runtime.plan import Plans
from pipeline.runtime.recompute import recomputing
from pipeline.runtime.saved_bytes import SavedBytes
from pipeline.runtime.split_backward import (
    WeightGrad,
    backward_input,
    backward_weight,
    release,
    run_backward,
)
from pipeline.runtime.stage_call import StageCall
from pipeline.runtime.step_io import LossFn, StepInputs, StepResult
from pipeline.runtime.syncs import handlers
from pipeline.runtime.weighting import zero_loss
from pipeline.schedstat import waited_between
from schedules import Action, Event, Op
from schedules.lower import Message

__all__ = ["LossFn", "StageRuntime", "StepInputs", "StepResult"]

@dataclass
class _Stash:
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...] | None  # None while checkpointed (only the inputs are kept)
    loss: torch.Tensor | None = None
    weight_grad: WeightGrad | None = None


class StageRuntime:
    """Holds one rank's stages and runs its actions: F, B, I, W, U, SEND, RECV and the syncs.

    It never looks at which schedule it is running: the actions say everything. Data between
    stages on this rank stays here; data for another rank waits in the outbox for its SEND.
    """

    def __init__(self, rank: int, stages: dict[int, nn.Module], device: torch.device,
                 num_stages: int, rank_of: Callable[[int], int], transport: Transport) -> None:
        self.rank = rank
        self.stages = stages
        self.device = device
        self.num_stages = num_stages
        self.rank_of = rank_of
        self.transport = transport
        self.call = StageCall(stages, device)  # the forwards (stage_call.py)
        self.events: list[Event] = []
        # On a GPU, the last run's events as the GPU ran them, computed when first asked for.
        self.pending: Callable[[], list[Event]] | None = None
        # The rest of a step's time, for its anatomy (benchmarks/anatomy.py), in seconds from
        # the step's t0 as `events`: each wait for a peer's message, each SEND/RECV action,
        # and the run's first and last instants. A clock read and an append per message.
        self.waits: list[tuple[Message, float, float]] = []
        self.comm: list[Event] = []
        self.span = (0.0, 0.0)
        self._t0 = 0.0
        self.peak_stashed = 0
        self.released_bytes = 0
        self.stashed_bytes = 0
        self.peak_stashed_bytes = 0
        # The stash plus the stage outputs whose storage is still held (until released after
        # their SEND, or until their backward): what a step's activations occupy at most.
        self.activation_bytes = self.peak_activation_bytes = 0
        self._stash: dict[tuple[int, int], _Stash] = {}
        # What each stash entry holds: (stashed bytes, bytes of outputs not yet released).
        self._bytes: dict[tuple[int, int], tuple[int, int]] = {}
        self._local: dict[Message, tuple[Any, ...]] = {}  # between stages of this rank
        self._outbox: dict[Message, tuple[Any, ...]] = {}  # produced, waiting for its SEND
        # Rows of each micro-batch's input, as split on the first stage: forwards to another
        # rank carry them (see _give), so the last stage checks its target against the input
        # it belongs to, whatever the layers made of the rows.
        self._rows: dict[int, int | None] = {}
        self.current: Action | None = None  # for error reports
        self._ready = 0.0  # when the current action had its inputs
        # schedule="auto"'s profiled step: per event of `events`, the seconds its thread waited
        # on a CPU's run queue from `_ready` to its end (empty in other steps), read through
        # `_wait` (the step's thread_wait; None: not read) from `_waited_at` on.
        self.queued: list[float] = []
        self._wait: Callable[[], int | None] | None = None
        self._waited_at: int | None = None
        # On a GPU the host's clock sees launches: the timeline takes CUDA events' times.
        self.gpu_clock = GpuClock(device) if device.type == "cuda" else None
        # The rows tensor a forward's message carries (see _give), one per row count.
        self._rows_of: dict[int, torch.Tensor] = {}
        self._plans = Plans({Op.F: self._forward, Op.B: self._backward, Op.I: self._backward,
                             Op.W: self._weight, Op.U: self._update, **handlers(self)},
                            self._send, self._post, rank_of)

    # -- driving ------------------------------------------------------------------------------
    def run(self, actions: Sequence[Action], step: StepInputs, result: StepResult) -> None:
        """Execute this rank's lowered actions for one step."""
        self.events, self.waits, self.comm, self.queued = [], [], [], []
        self.peak_stashed = self.stashed_bytes = self.peak_stashed_bytes = 0
        self.released_bytes = self.activation_bytes = self.peak_activation_bytes = 0
        for store in (self._stash, self._bytes, self._local, self._outbox, self._rows):
            store.clear()
        self.call.begin()
        with step.caller.step():
            self._run(actions, step, result)

    def _run(self, actions: Sequence[Action], step: StepInputs, result: StepResult) -> None:
        events, comm, t0, clock = self.events, self.comm, step.t0, time.perf_counter
        gpu, rank, queued = self.gpu_clock, self.rank, self.queued
        # On a GPU the events take the GPU's times, which no host thread's wait is part of.
        wait = self._wait = step.thread_wait if gpu is None else None
        self._t0 = t0
        first = clock()
        if gpu is not None:
            gpu.begin(first - t0)
        for action, handler, moves in self._plans.of(actions):
            self.current = action
            self._ready = clock()
            if wait is not None and not moves:
                self._waited_at = wait()
            if gpu is not None and not moves:  # a message's time is the host's
                gpu.ready()
            handler(action, step, result)
            if not moves:
                # Compute (and sync) time only: waiting for a peer's data is idle time (a
                # bubble), so the clock starts when the handler has its inputs (see _take).
                if wait is not None:
                    queued.append(waited_between(self._waited_at, wait()))
                events.append(Event(rank, action, self._ready - t0, clock() - t0))
                if gpu is not None:
                    gpu.done(len(events) - 1)
            else:
                comm.append(Event(rank, action, self._ready - t0, clock() - t0))
        # On a GPU, the events' GPU times are read when the timeline is (see timed_events).
        self.pending = gpu.resolver(events) if gpu is not None else None
        self.span = (first - t0, clock() - t0)
        self.current = None
        if self._stash or self._outbox:  # internal invariant: a validated schedule frees all
            raise AssertionError(f"rank {self.rank}: left {sorted(self._stash)} stashed and "
                                 f"{sorted(self._outbox)} unsent")

    def _send(self, msg: Message, dst: int, action: Action, step: StepInputs,
              result: StepResult) -> None:
        self.transport.send(msg, self._outbox.pop(msg), dst)
        stash = self._stash.get((msg[1] - 1, msg[2])) if msg[0] == "F" else None
        if stash is not None and stash.outputs is not None and self.transport.copies:
            # The next stage has its copy of the activations; the backward needs only their
            # graph (and the incoming gradient's shape).
            released = release(stash.outputs)
            self.released_bytes += released
            if step.track_memory:
                stashed, held = self._bytes[msg[1] - 1, msg[2]]
                self._bytes[msg[1] - 1, msg[2]] = (stashed, held - released)
                self.activation_bytes -= released

    def _post(self, msg: Message, src: int, action: Action, step: StepInputs,
              result: StepResult) -> None:
        self.transport.post(msg, src)

    def wait_for(self, msg: Message, src: int) -> tuple[Any, ...]:
        """`msg` from rank `src`, waited for; the current action has its inputs from then on."""
        waited = time.perf_counter()
        values = self.transport.wait(msg, src, self.device)
        self._ready = time.perf_counter()
        if self._wait is not None:
            self._waited_at = self._wait()
        if self.gpu_clock is not None:
            self.gpu_clock.ready()
        self.waits.append((msg, waited - self._t0, self._ready - self._t0))
        return values

    def _take(self, msg: Message, src_stage: int) -> tuple[Any, ...]:
        """The data `msg` carries: from this rank's own stage, or waited for from a peer."""
        src = self.rank_of(src_stage)
        if src == self.rank:
            values = self._local.pop(msg)
            return move(values, self.device, grad_flags=[
                isinstance(v, torch.Tensor) and v.requires_grad for v in values])
        values = self.wait_for(msg, src)
        if msg[0] == "F":
            self._rows[msg[2]] = values[-1].shape[0]
            values = like(values, values[:-1])
        return values

    def _give(self, msg: Message, values: tuple[Any, ...]) -> None:
        if self.rank_of(msg[1]) == self.rank:
            self._local[msg] = values
        elif msg[0] == "F":
            # The input's rows ride along as the shape of an empty tensor: in the header only,
            # sent when it changes, read without waiting on a device.
            # Known here: set by stage 0's forward (check_batch made sure the input has rows)
            # or by the message that brought this micro-batch to this rank.
            count = self._rows[msg[2]]
            assert count is not None, f"micro-batch {msg[2]}: its input rows are unknown"
            rows = self._rows_of.get(count)
            if rows is None:  # it holds no data: one serves every message of its count
                rows = self._rows_of[count] = torch.empty((count, 0), dtype=torch.uint8,
                                                          device=self.device)
            self._outbox[msg] = like(values, (*values, rows))
        else:
            self._outbox[msg] = values

    # -- forward ------------------------------------------------------------------------------
    def _forward(self, action: Action, step: StepInputs, result: StepResult) -> None:
        s, m = action.stage, action.microbatch
        if s == 0:  # inputs that require grad get theirs (microbatch.backward_inputs)
            given = step.inputs[m]
            self._rows[m] = step.rows[m] if step.rows is not None else leading_rows(given)
            inputs = move(given, self.device, grad_flags=[
                step.loss_fn is not None and isinstance(v, torch.Tensor) and v.requires_grad
                for v in given])
        else:
            inputs = self._take(("F", s, m), s - 1)
        train = step.loss_fn is not None
        keep_graph = train and not step.checkpointed[m]
        saved_bytes = 0  # what autograd saved: counted only where memory is tracked
        if step.track_memory and keep_graph:
            with torch.enable_grad(), SavedBytes() as saved:
                outputs = self.call(action, inputs, step)
            saved_bytes = saved.bytes
        elif torch.is_grad_enabled() == keep_graph:  # as wanted already: no switch to make
            outputs = self.call(action, inputs, step)
        else:
            with torch.set_grad_enabled(keep_graph):
                outputs = self.call(action, inputs, step)
        last = s == self.num_stages - 1
        if not train:
            if last:
                result.outputs[m] = like(outputs, (o.detach() if isinstance(o, torch.Tensor)
                                                   else o for o in outputs))
            else:
                self._give(("F", s + 1, m), outputs)
            return
        loss = None
        if last:
            loss, own = self._loss(outputs, m, step)
            result.losses[m], result.own_losses[m] = loss.detach(), own.detach()
        elif keep_graph:
            self._give(("F", s + 1, m), outputs)
        else:
            # Run without a graph, nothing requires grad; the replay will. Mark floating
            # outputs so the next stage still computes (and returns) their gradients.
            self._give(("F", s + 1, m), like(outputs, (
                o.detach().requires_grad_(True) if isinstance(o, torch.Tensor)
                and o.is_floating_point() else o for o in outputs)))
        input_bytes = sum(t.numel() * t.element_size() for t in inputs
                          if isinstance(t, torch.Tensor))
        self._stash[(s, m)] = _Stash(inputs, outputs if keep_graph else None, loss)
        self.peak_stashed = max(self.peak_stashed, len(self._stash))
        self.stashed_bytes += input_bytes + saved_bytes
        self.peak_stashed_bytes = max(self.peak_stashed_bytes, self.stashed_bytes)
        held = 0 if not (step.track_memory and keep_graph) else sum(
            o.numel() * o.element_size() for o in outputs
            if isinstance(o, torch.Tensor) and o.grad_fn is not None)
        self.activation_bytes += input_bytes + saved_bytes + held
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes)
        self._bytes[(s, m)] = (input_bytes + saved_bytes, held)

    def _loss(self, outputs: tuple[Any, ...], m: int, step: StepInputs
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `m`'s loss weighted by its share of the batch's, and its own loss."""
        assert step.loss_fn is not None and step.targets is not None
        target = step.targets[m]
        rows = self._rows.get(m)
        target_rows = (step.target_rows[m] if step.target_rows is not None
                       else leading_rows(target))
        if rows is not None and target_rows is not None and rows != target_rows:
            # A rank given another batch than its peers: a loss would broadcast one against
            # the other and train silently wrong. (The output's rows are the model's business:
            # a head may flatten tokens into rows.)
            raise PipeConfigError(
                f"micro-batch {m}: its target has {target_rows} rows but its input had "
                f"{rows}; every rank must pass the same batch (one target row per input row)")
        weight = step.loss_weights[m]
        if weight == 0 or math.isnan(weight):
            # Nothing counted in this micro-batch (its own mean would be 0/0), or in the whole
            # batch (NaN, as torch's mean over nothing): add nothing, pass zero gradients.
            zero = zero_loss(outputs) + weight
            return zero, torch.full_like(zero.detach(), math.nan)
        with step.caller.forward():  # plain training computes the loss under autocast too
            loss = step.loss_fn(from_tuple(outputs), target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(
                f"loss_fn must return a 0-dim tensor (a mean over the micro-batch); got "
                f"{type(loss).__name__} with shape {getattr(loss, 'shape', None)}"
            )
        return loss * weight, loss

    # -- backward -----------------------------------------------------------------------------
    def _recompute(self, action: Action, stash: _Stash, step: StepInputs) -> None:
        with torch.enable_grad(), recomputing():
            stash.outputs = self.call(action, stash.inputs, step, replay=True)
        if action.stage == self.num_stages - 1:
            stash.loss = self._loss(stash.outputs, action.microbatch, step)[0]

    def _backward(self, action: Action, step: StepInputs, result: StepResult) -> None:
        s, m = action.stage, action.microbatch
        stash = self._stash[(s, m)]
        if stash.outputs is None:
            self._recompute(action, stash, step)
        assert stash.outputs is not None
        if s == self.num_stages - 1:
            assert stash.loss is not None
            roots: list[torch.Tensor] = [stash.loss if step.scaler is None
                                         else step.scaler.scale(stash.loss)]
            grads: list[torch.Tensor] = [torch.ones_like(stash.loss)]
        else:
            incoming = self._take(("B", s, m), s + 1)
            pairs = [(o, g) for o, g in zip(stash.outputs, incoming, strict=True)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            roots, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if action.op is Op.B:
            if roots:
                run_backward(roots, grads)  # roots may be released outputs (see _send)
            input_grads = [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None
                           for t in stash.inputs]
            self._free(s, m)
        else:  # I: input gradients now, weight gradients at this micro-batch's W
            params = self._params(action, step)
            input_grads, stash.weight_grad = backward_input(roots, grads, stash.inputs, params)
        if s > 0:
            self._give(("B", s - 1, m), sendable(tuple(input_grads)))
        elif any(g is not None for g in input_grads):
            result.input_grads[m] = tuple(input_grads)

    def _params(self, action: Action, step: StepInputs) -> list[torch.Tensor]:
        if action.version is None:
            return list(self.stages[action.stage].parameters())
        assert step.versions is not None
        return list(step.versions.weights(action.stage, action.version).values())

    def _weight(self, action: Action, step: StepInputs, result: StepResult) -> None:
        stash = self._stash[(action.stage, action.microbatch)]
        assert stash.weight_grad is not None, f"{action} before its I"
        backward_weight(stash.weight_grad)
        self._free(action.stage, action.microbatch)

    def _free(self, s: int, m: int) -> None:
        del self._stash[(s, m)]
        stashed, held = self._bytes.pop((s, m))
        self.stashed_bytes -= stashed
        self.activation_bytes -= stashed + held

    def _update(self, action: Action, step: StepInputs, result: StepResult) -> None:
        assert step.versions is not None, f"{action} needs weight versions"
        step.versions.update(action.stage, action.microbatch)
