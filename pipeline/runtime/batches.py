"""A step's inputs on one rank: its share of the batches, their loss weights, the syncs' calls."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from pipeline.errors import PipeConfigError
from pipeline.runtime import weighting
from pipeline.runtime.context import CallerState
from pipeline.runtime.microbatch import from_tuple, like, split
from pipeline.runtime.stage import LossFn, StepInputs
from pipeline.runtime.syncs import StepSyncs
from pipeline.runtime.tokens import Cut
from pipeline.splitting import checks
from schedules import Schedule

__all__ = ["one_at_a_time", "share", "step_inputs"]


class _Share(NamedTuple):
    """A batch cut on this rank: what `share` returns, and the rows it counted."""

    inputs: list[tuple[Any, ...]]
    targets: list[Any] | None
    weights: list[float]
    rows: Sequence[int | None]  # each micro-batch input's rows (None where not cut here)
    target_rows: Sequence[int | None]  # each target's


def share(pipe: Any, x: Any, target: Any, loss_fn: LossFn | None, chunks: int,
          how: weighting.Weighting | None = None, cut: Cut | None = None
          ) -> tuple[list[tuple[Any, ...]], list[Any] | None, list[float]]:
    """This rank's share of a batch: first-stage inputs, last-stage targets, loss weights
    (`how` weighs them: see pipeline/runtime/weighting.py); `cut`: token micro-batches
    (pipeline/runtime/tokens.py), else rows split evenly."""
    inputs, targets, weights, _, _ = _cut(pipe, x, target, loss_fn, chunks, how, cut)
    return inputs, targets, weights


def _cut(pipe: Any, x: Any, target: Any, loss_fn: LossFn | None, chunks: int,
         how: weighting.Weighting | None, cut: Cut | None) -> _Share:
    """`share`, with each micro-batch's rows as the split counted them: the input and the
    target each split once, their rows counted once, for the weights and the stages."""
    checks.check_batch(x, target, chunks)
    last = len(pipe.balance) - 1
    rank = pipe.world[0] if pipe.world else None
    counted = how is not None and how.from_inputs is not None  # from the inputs
    parts_x: list[tuple[Any, ...]] = [()] * chunks
    rows_x: Sequence[int | None] = [None] * chunks
    rows: Sequence[int | None] = [None] * chunks
    if 0 in pipe.local_stages or (counted and last in pipe.local_stages):
        if x is None:
            why = ("holds the first stage and needs the input" if 0 in pipe.local_stages else
                   "holds the last stage, whose loss is the model's own (weighted by what it "
                   "counts in its inputs, labels= and all)")
            raise PipeConfigError(f"rank {rank} {why}: pass x (only other ranks may pass "
                                  f"None)")
        parts_x, rows_x = _split(x, chunks, cut, target=False)
    inputs = parts_x if 0 in pipe.local_stages else [()] * chunks  # the last's are counted
    targets = None
    weights = [1.0 / chunks] * chunks
    if loss_fn is not None and last in pipe.local_stages:
        assert how is not None
        if target is None and not how.model_loss:
            if how.inexact is not None:
                raise PipeConfigError(weighting.inexact_message(how, refusing=True))
            raise PipeConfigError(
                "the last stage computes the loss from the target: pass target, as loss_fn "
                "reads it (a loss_fn returning the model's own loss, lambda out, y: out.loss, "
                "takes target None where Pipe can weigh that loss; docs/losses.md)"
                if rank is None else
                f"rank {rank} holds the last stage and computes the loss: pass target (only "
                f"other ranks may pass None)")
        device = pipe.devices[pipe._probe.rank_of(last)]
        parts, rows = (([(None,)] * chunks, rows) if target is None else
                       _split(target, chunks, cut, target=True))
        values = [from_tuple(p) for p in parts]  # as loss_fn receives them
        measures = how.measures(values, parts_x if counted else (), rows)
        total, scale = (pipe._replicas.weighting(sum(measures)) if pipe._replicas
                        else (sum(measures), 1.0))
        weights = how.weights(measures, total, scale)
        if not pipe._warned_padding and (how.inexact or how.looks_padded(values)):
            pipe._warned_padding = True  # once per Pipe
            warnings.warn(weighting.inexact_message(how, refusing=False) if how.inexact
                          else weighting.padding_warning(loss_fn), UserWarning, stacklevel=5)
        # Every micro-batch's entries come from the same tensors: on the device already if
        # the first's are (then moving would give back the same values).
        here = all(v.device == device for v in parts[0] if isinstance(v, torch.Tensor))
        targets = values if here else [
            from_tuple(like(part, (v.to(device) if isinstance(v, torch.Tensor) else v
                                   for v in part))) for part in parts]
    return _Share(inputs, targets, weights, rows_x if 0 in pipe.local_stages else
                  [None] * chunks, rows)


def _split(value: Any, chunks: int, cut: Cut | None, target: bool
           ) -> tuple[list[tuple[Any, ...]], Sequence[int | None]]:
    """`value` as the step's micro-batches and each one's rows, in one pass: rows split
    evenly, or the token micro-batches of `cut` (the input's trimmed entries, or a target's)."""
    return split(value, chunks) if cut is None else cut.split(value, target)


def step_inputs(pipe: Any, program: Schedule, pairs: list[tuple[Any, Any]], loss_fn: LossFn,
                how: weighting.Weighting, scaler: Any, seed: int,
                cuts: Sequence[Cut | None] = ()) -> StepInputs:
    """What every rank's part of `program` reads: this rank's share of the batches (cut to
    their tokens where `cuts` says), and what the program's syncs call."""
    m = pipe.chunks
    inputs: list[tuple[Any, ...]] = []
    targets: list[Any] = []
    weights: list[float] = []
    rows: list[int | None] = []
    target_rows: list[int | None] = []
    for b, (x, target) in enumerate(pairs):
        one = _cut(pipe, x, target, loss_fn, m, how, cuts[b] if cuts else None)
        inputs += one.inputs
        targets += one.targets or []
        weights += one.weights
        rows += one.rows
        target_rows += one.target_rows
    total = m * len(pairs)
    checkpointed = [pipe.checkpoint == "always" or (pipe.checkpoint == "except_last"
                                                    and k % m != m - 1) for k in range(total)]
    versioned = pipe._programs.versioned(program)
    replicas = pipe._replicas
    syncs = StepSyncs(ties=pipe._tie_link if pipe._ties else None,
                      reduce=replicas.grads_ready if replicas is not None else None,
                      wait=replicas.wait_grads if replicas is not None else None,
                      overflow=(lambda: pipe._agree_on_overflow(scaler))
                      if scaler is not None else None)
    return StepInputs(inputs, targets, loss_fn, weights, checkpointed, seed,
                      versions=pipe._versions if versioned else None,
                      track_memory=pipe.track_memory, caller=CallerState.capture(),
                      scaler=scaler, syncs=syncs, rows=rows, target_rows=target_rows,
                      thread_wait=pipe.auto.profiling() if pipe.auto is not None else None)


def one_at_a_time(step: Callable[[Any, Any], torch.Tensor], pairs: Sequence[tuple[Any, Any]],
                  optimizer: torch.optim.Optimizer, scaler: Any) -> list[torch.Tensor]:
    """`step_many` batch by batch: `step(x, target)`, then the optimizer (through `scaler`,
    if any), each batch from cleared gradients; they are left cleared (None)."""
    losses = []
    for x, target in pairs:
        optimizer.zero_grad(set_to_none=True)
        losses.append(step(x, target))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return losses
