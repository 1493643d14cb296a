"""Loss weighting: the factor on each micro-batch's loss that makes them add up to the batch's.

A loss that averages divides by what it averages over, and a micro-batch's mean is over its own
share of that: rows for most losses, but counted targets for a cross-entropy with ignored
positions (padding labelled -100, the Hugging Face convention) or class weights (torch divides
by the sum of the targets' weights), and whatever a user's loss masks or weighs. Weighting each
micro-batch by its rows there trains silently wrong (the gradient-accumulation normalisation
bug). So each micro-batch is weighted by `measure(target) / total`, the total taken over the
whole batch (over every replica's shard under data parallelism), and the sum of the weighted
micro-batch losses is the batch's loss exactly:

- `nn.CrossEntropyLoss`, `nn.NLLLoss`, `F.cross_entropy`, `F.nll_loss` (also as a
  `functools.partial`): class-index targets not equal to `ignore_index`, each counted by its
  class weight; class-probability targets by their positions (what torch divides by);
- any loss, with `loss_weight=fn`: `fn(target)` per micro-batch, a number >= 0;
- a model split from its graph whose own 0-dim loss `loss_fn` returns as it is (Hugging Face's
  `labels=` and `lambda out, y: out.loss`): what the graph's loss divides by, counted from each
  micro-batch's inputs by the graph's own ops (a causal LM's shift included; see
  `from_model` and pipeline/splitting/scalars.py);
- otherwise rows; a loss that sums (`reduction="sum"`) adds micro-batch losses unweighted.

A micro-batch whose measure is 0 adds nothing (its own mean would be 0/0); a batch whose total is
0 has a NaN loss and zero gradients, as torch's mean over nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.errors import PipeConfigError, PipeTypeError
from pipeline.runtime.microbatch import leading_rows
from pipeline.splitting.positions import paths as output_paths

__all__ = ["LossWeight", "Weighting", "from_model", "inexact_message", "padding_warning",
           "resolve", "zero_loss"]

LossWeight = Callable[[Any], Any]  # target -> a number >= 0 (int, float or 0-dim tensor)

# How a loss reduces over a micro-batch -> whether micro-batch losses are weighted (a mean).
_REDUCTIONS = {"mean": True, "batchmean": True, "sum": False}
_COUNTING = (F.cross_entropy, F.nll_loss)  # the functions behind the two modules too
PADDING = -100  # torch's default ignore_index, and Hugging Face's label for padding


@dataclass(frozen=True)
class Weighting:
    """How one step weighs its micro-batch losses (see the module docstring)."""

    mean: bool  # False: the loss sums, micro-batch losses add up unweighted
    measure: Callable[[Any], Any]  # what a micro-batch's mean is over, from its target
    by_rows: bool  # the measure is rows because nothing said otherwise (see `looks_padded`)
    # The model's own loss (`from_model`): loss_fn reads no target; a mean's measure comes
    # from a micro-batch's flattened inputs
    model_loss: bool = False
    from_inputs: Callable[[Sequence[Any]], float] | None = None
    # The model's own loss that no weighting of micro-batches reproduces: (its output's
    # path, why, the path of a mixture of experts' load-balancing loss it adds, or "")
    inexact: tuple[str, str, str] | None = None

    def measures(self, targets: Sequence[Any], inputs: Sequence[Sequence[Any]] = (),
                 rows: Sequence[int | None] = ()) -> list[float]:
        """Each micro-batch's measure, from its target as `loss_fn` receives it (or from its
        inputs, for the model's own loss); `rows`: each target's rows, where the cut counted
        them (a measure by rows then counts nothing again)."""
        if not self.mean:
            return [1.0] * len(targets)
        if self.from_inputs is not None:
            return [self.from_inputs(part) for part in inputs]
        if self.measure is _rows and len(rows) == len(targets) and None not in rows:
            return [float(r) for r in rows if r is not None]
        out = []
        for m, target in enumerate(targets):
            value = self.measure(target)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                kind = "" if ok else f", a {type(value).__name__}"
                raise PipeConfigError(
                    f"loss_weight(target) must be a finite number >= 0 (got {value!r}{kind} "
                    f"for micro-batch {m}): it is what that target's loss averages over, e.g. "
                    f"its count of tokens not labelled -100")
            out.append(float(value))
        return out

    def weights(self, measures: Sequence[float], total: float, scale: float = 1.0
                ) -> list[float]:
        """Per micro-batch, `scale` x its share of `total` (a mean) or `scale` (a sum)."""
        if not self.mean:
            return [scale] * len(measures)
        if total == 0:  # torch's mean over no counted target is NaN, its gradient zero
            return [math.nan] * len(measures)
        return [m / total * scale for m in measures]

    def looks_padded(self, targets: Sequence[Any]) -> bool:
        """Rows weigh the micro-batches of a plain function, yet its integer targets hold the
        padding label: the loss probably averages over tokens (worth a warning)."""
        return self.mean and self.by_rows and any(
            isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool
            and bool((t == PADDING).any()) for t in targets)


def resolve(loss_fn: object, loss_reduction: str | None,
            loss_weight: LossWeight | None, model: Any = None,
            whole_batch: bool = False) -> Weighting:
    """The weighting of `loss_fn`: its reduction (a loss module's `reduction`, a partial's
    keyword, or `loss_reduction` for a plain function; default "mean") and its measure
    (`model`: a SplitModel, whose own loss `loss_fn` may return; see `from_model`;
    `whole_batch`: the step runs the batch as one micro-batch)."""
    reduction = _reduction(loss_fn, loss_reduction)
    mean = _REDUCTIONS[reduction]
    if loss_weight is not None:
        if not callable(loss_weight):
            raise PipeTypeError(f"loss_weight must be callable as loss_weight(target) -> number "
                                f"(got {loss_weight!r}); e.g. loss_weight=lambda target: "
                                f"(target != -100).sum() for a loss averaged over tokens")
        if not mean:
            raise PipeConfigError(
                f"loss_weight= weighs micro-batch means, but the loss reduces by "
                f"{reduction!r}: micro-batch sums add up as they are; drop loss_weight, or "
                f"reduce by 'mean'")
        return Weighting(True, functools.partial(_user_measure, loss_weight), False)
    counting = _counting(loss_fn)
    if counting is not None:
        return Weighting(mean, functools.partial(_counted, *counting), False)
    plain = not isinstance(loss_fn, nn.modules.loss._Loss)
    how = Weighting(mean, _rows, plain)
    if plain and loss_reduction is None and callable(loss_fn):
        return from_model(how, loss_fn, model, whole_batch)
    return how


def from_model(how: Weighting, loss_fn: Callable[[Any, Any], Any], model: Any,
               whole_batch: bool = False) -> Weighting:
    """`how`, or, for a plain `loss_fn` with nothing said (no `loss_weight=`, no reduction)
    that returns a 0-dim output of `model` (a SplitModel) as it is, that output's own rule:
    its micro-batches weighted by what the graph's mean divides by (counted from the inputs),
    or added up for a sum. Where the graph cannot say (a loss that adds a token mean and a
    row mean), `how` as before, marked `inexact` (a warning, or a refusal without a target,
    says so), unless the batch runs whole (`whole_batch`, or one packed row): weight 1."""
    if model is None or not (how.mean and how.by_rows):
        return how
    mode = model.mode
    scalars = model.scalars[mode]
    leaf = scalars.returned(loss_fn, model.out_specs[mode])
    if leaf is None:
        return how
    if leaf not in scalars.combine:
        # No weighting of micro-batches reproduces it; but a model captured with one row of
        # every input (a collator's single packed row) runs each batch as one micro-batch,
        # whose loss is the batch's: weight 1.
        if whole_batch or len(model.broadcast) == len(model.input_names):
            return Weighting(False, how.measure, False, model_loss=True)
        paths = output_paths(model.out_specs[mode], scalars.num_leaves)
        aux = next((f"output{paths[k]}" for k in scalars.refused if "aux_loss" in paths[k]), "")
        return dataclasses.replace(how, inexact=(f"output{paths[leaf]}",
                                                 scalars.refused[leaf], aux))
    kind = scalars.combine[leaf][0]
    if kind == "sum":
        return Weighting(False, how.measure, False, model_loss=True)
    counter = scalars.counters.get(leaf)
    if kind != "mean" or counter is None:
        return how
    return Weighting(True, how.measure, False, model_loss=True,
                     from_inputs=functools.partial(counter, list(model.input_names)))


def inexact_message(how: Weighting, refusing: bool) -> str:
    """What to say of the model's own loss no weighting reproduces (`how.inexact`): what is
    exact and what is not, and the ways out; `refusing`: a step without a target."""
    assert how.inexact is not None
    path, why, aux = how.inexact
    if aux:
        what = (f"it adds {aux}, the load-balancing loss of output_router_logits=True, a "
                f"product of two means over the batch's tokens. Micro-batches weighted by the "
                f"tokens they count (loss_weight=) give the token mean exactly, but {aux} is "
                f"then taken per micro-batch and averaged: an approximation of the batch's")
        exact = (", or build the model with output_router_logits=False (its loss is then the "
                 "token mean alone, weighed exactly without a target; no load-balancing loss "
                 "is trained)")
        example = "lambda t: (t[:, 1:] != -100).sum(), the shifted tokens a causal LM counts"
    else:
        what = ("weighted by rows or by loss_weight=, it is its micro-batches' weighted mean, "
                "an approximation of the batch's")
        exact = ""
        example = "lambda t: (t != -100).sum()"
    head = ("" if refusing else "Pipe weighs its micro-batches by rows, and ")
    target = " with the labels as target" if refusing else ""
    return (f"{head}loss_fn returns the model's own {path}, which no weighting of "
            f"micro-batches reproduces (a 0-dim value {why}): {what}. For it exactly, run the "
            f"batch as one micro-batch (Pipe(..., chunks=1)){exact}; to accept the "
            f"approximation, pass loss_weight={target} (what the loss averages over, e.g. "
            f"loss_weight={example}; docs/losses.md)")


def padding_warning(loss_fn: object) -> str:
    """What to say when `Weighting.looks_padded`: the likely bug and its fix."""
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    return (f"the target holds -100 (the label of padding and ignored tokens) and loss_fn "
            f"{name} is a plain function, so Pipe weighs its micro-batches by their rows; a "
            f"loss that averages over counted tokens then trains wrong. Pass "
            f"loss_weight=lambda target: (target != -100).sum() (what the loss averages over), "
            f"or use nn.CrossEntropyLoss, which Pipe weighs by its counted targets "
            f"(docs/losses.md)")


def zero_loss(outputs: Sequence[Any]) -> torch.Tensor:
    """A 0 connected to the stage's outputs: a micro-batch that adds nothing still runs its
    backward (the schedule's B), passing exact zero gradients back, never 0 x NaN."""
    zero: torch.Tensor | None = None
    for o in outputs:
        if isinstance(o, torch.Tensor) and o.requires_grad:
            term = o.sum() * 0.0
            zero = term if zero is None else zero + term
    if zero is None:  # nothing requires grad (a frozen last stage): a constant zero
        first = next((o for o in outputs if isinstance(o, torch.Tensor)), None)
        return torch.zeros((), device=first.device if first is not None else None)
    return torch.nan_to_num(zero, nan=0.0, posinf=0.0, neginf=0.0)


def _reduction(loss_fn: object, loss_reduction: str | None) -> str:
    declared = getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, functools.partial) and loss_fn.func in _COUNTING:
        declared = loss_fn.keywords.get("reduction", "mean")
    if loss_reduction is not None and declared is not None and loss_reduction != declared:
        raise PipeConfigError(f"loss_reduction={loss_reduction!r} but the loss module reduces "
                              f"by {declared!r}: leave loss_reduction out for a loss module")
    reduction = loss_reduction or declared or "mean"
    if reduction not in _REDUCTIONS:
        raise PipeConfigError(f"loss reduction must be one of {sorted(_REDUCTIONS)} (got "
                              f"{reduction!r}): Pipe needs a 0-dim loss per micro-batch to "
                              f"combine; reduce by 'mean' or 'sum'")
    return str(reduction)


def _counting(loss_fn: object) -> tuple[int, torch.Tensor | None] | None:
    """(ignore_index, class weight) of a cross-entropy or NLL loss; None for other losses."""
    if isinstance(loss_fn, nn.CrossEntropyLoss | nn.NLLLoss):
        return loss_fn.ignore_index, loss_fn.weight
    if loss_fn in _COUNTING:
        return PADDING, None
    if isinstance(loss_fn, functools.partial) and loss_fn.func in _COUNTING and not loss_fn.args:
        return (int(loss_fn.keywords.get("ignore_index", PADDING)),
                loss_fn.keywords.get("weight"))
    return None


def _rows(target: Any) -> float:
    rows = leading_rows(target)
    assert rows is not None, "scatter split the target along dim 0"
    return float(rows)


def _counted(ignore_index: int, weight: torch.Tensor | None, target: Any) -> float:
    """What torch's mean divides by for this target (see the module docstring)."""
    if not isinstance(target, torch.Tensor):
        return _rows(target)
    if target.is_floating_point():  # class probabilities, (N, C, d1, ...): per position
        return float(target.numel() // target.shape[1]) if target.dim() > 1 else 1.0
    counted = target[target != ignore_index]
    if weight is None:
        return float(counted.numel())
    if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= weight.numel()):
        bad = int(counted.min()) if int(counted.min()) < 0 else int(counted.max())
        raise PipeConfigError(f"the target holds class {bad}, but the loss's class weight has "
                              f"{weight.numel()} classes: targets are class indices in "
                              f"[0, {weight.numel()}) or ignore_index ({ignore_index})")
    w = weight.detach().to(device=counted.device, dtype=torch.float64)
    return float(w[counted].sum())


def _user_measure(loss_weight: LossWeight, target: Any) -> Any:
    value = loss_weight(target)  # checked by `Weighting.measures`, which names the micro-batch
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
