"""Token micro-batches: rows grouped by balanced tokens, each micro-batch cut to its longest row.

A batch padded to its longest row spends most of its compute on padding when lengths are long
tailed. With `tokens=True` (or `tokens=lengths`), a step sorts the rows by length, groups them
into `chunks` micro-batches of balanced cost (rows x the group's longest row: what a micro-batch
computes once trimmed), and trims every tensor of a micro-batch whose dim 1 is the padded length
(the ids, the mask, the labels, the target) to its longest row. Rows that attend only to earlier
or unmasked positions (a causal model, or a mask that zeroes padded keys) give the same values
at their tokens, so with padding labelled -100 the loss counts the same tokens and the loss and
every gradient are the unsplit model's on the padded batch (to the rounding of other matmul
shapes). `pipe(x)` pads each micro-batch's outputs back (zeros where the batch had padding) and
puts the rows back in the caller's order.

Refused before any work: a model with BatchNorm (rows are not independent: trimming changes its
statistics), padding that is not trailing, lengths that disagree with the mask, counted labels
on padding (they would be cut away), a target one position shorter than the inputs (labels
shifted outside the loss: it would not be trimmed with them), and inputs that require grad.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.errors import PipeConfigError
from pipeline.runtime import token_outputs
from pipeline.runtime.microbatch import MicroBatchError, as_tuple, like
from pipeline.runtime.token_costs import TokenCosts
from pipeline.runtime.token_groups import group, order
from pipeline.splitting.positions import Layout, Positions, paths
from schedules import Op, Schedule

__all__ = ["Cut", "cut_batch", "cuts", "group", "order", "padded", "plan", "restored"]

PADDING = -100  # the label of padding (torch's ignore_index, Hugging Face's)
MASK_NAME = "attention_mask"  # where a model split from its graph takes its mask
LABEL_NAMES = ("labels",)  # inputs whose padding must not be counted


@dataclass(frozen=True)
class Cut:
    """How one batch of `rows` rows padded to `length` runs: the rows of each micro-batch (in
    run order) and the length each is trimmed to; `trim`, the entries of the input that run
    along the positions (None: every one whose dim 1 is the padded length), and `layouts`, how
    each output is put back together (pipeline/splitting/positions.py; None: by its sizes)."""

    rows: int
    length: int
    groups: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    trim: frozenset[int] | None = None
    layouts: tuple[Layout, ...] | None = None

    @property
    def costs(self) -> tuple[float, ...]:
        """Each micro-batch's tokens computed (rows x trimmed length)."""
        return tuple(float(len(g) * n) for g, n in zip(self.groups, self.lengths, strict=True))

    def apply(self, value: Any) -> list[tuple[Any, ...]]:
        """The input `value` (a tensor or a tuple, as `scatter` takes) as the micro-batches:
        rows of each group, dim 1 trimmed in the entries that run along the positions."""
        return self.split(value)[0]

    def target(self, value: Any) -> list[tuple[Any, ...]]:
        """The target as the micro-batches: dim 1 trimmed where it is the padded length (no
        graph says what a target is)."""
        return self.split(value, target=True)[0]

    def split(self, value: Any, target: bool = False
              ) -> tuple[list[tuple[Any, ...]], list[int | None]]:
        """`apply` (or `target`), and each micro-batch's rows (its `leading_rows`), counted
        as the parts are made."""
        values = as_tuple(value)
        trim = None if target else self.trim
        parts, rows = [], []
        for index, n in zip(self._indices, self.lengths, strict=True):
            part = [self._part(v, index, n, trim is None or i in trim)
                    for i, v in enumerate(values)]
            parts.append(like(values, part))
            rows.append(max((int(v.shape[0]) for v in part
                             if isinstance(v, torch.Tensor) and v.dim() > 0), default=None))
        return parts, rows

    @functools.cached_property
    def _indices(self) -> tuple[torch.Tensor, ...]:
        """Each group's rows as an index, made once for the input and the target."""
        return tuple(torch.tensor(g, dtype=torch.long) for g in self.groups)

    def _part(self, v: Any, index: torch.Tensor, n: int, positions: bool) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v
        if v.shape[0] == self.rows:
            v = v.index_select(0, index.to(v.device))
        elif v.shape[0] != 1:  # `batch_size` has refused it before
            return v
        # A tensor of one row beside the batch (position_ids of shape (1, T)) is trimmed too;
        # contiguous, as the caller's was: a model may `view` it (RoBERTa's loss views its
        # labels).
        if positions and v.dim() >= 2 and v.shape[1] == self.length:
            return v[:, :n].contiguous()
        return v

    def pad(self, outputs: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Each micro-batch's outputs, those along the positions padded back to the batch's
        length (see pipeline/runtime/token_outputs.py)."""
        return token_outputs.pad(outputs, self.groups, self.lengths, self.length, self.layouts)

    def restore(self, value: Any) -> Any:
        """`value` (the batch's output, rows in run order) with its rows in the caller's order."""
        inverse = torch.empty(self.rows, dtype=torch.long)
        inverse[torch.tensor([r for g in self.groups for r in g])] = torch.arange(self.rows)
        return token_outputs.reorder(value, inverse, self.layouts)


def plan(x: Any, chunks: int, tokens: Any, names: Sequence[str] | None = None,
         program: Schedule | None = None, measured: TokenCosts | None = None,
         positions: Positions | None = None, outputs: Sequence[str] = ()) -> Cut:
    """The cut of batch `x` (a flattened tuple; `names` name its entries for a model split from
    its graph, `positions` says which run along the positions and `outputs` names its
    outputs) into `chunks` token micro-batches: from its attention mask, or from `tokens`
    given as the rows' lengths (checked against the mask where there is one)."""
    values = as_tuple(x)
    at = _find_mask(values, names)
    mask = values[at] if at is not None else None
    given = None if tokens is True else torch.as_tensor(tokens).reshape(-1)
    if mask is None and given is None:
        raise PipeConfigError(
            "tokens=True cuts micro-batches to their tokens from the attention mask, but the "
            "input has none (a dict input's 'attention_mask', or the second entry of an (ids, "
            "mask) tuple, of the ids' shape): pass tokens=lengths, one token count per row")
    if mask is not None:
        lengths = _trailing(mask)
        length = int(mask.shape[1])
    else:
        assert given is not None
        at = next((i for i, v in enumerate(values)
                   if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
        if at is None:
            raise PipeConfigError("tokens=lengths trims dim 1 of the input, but no input tensor "
                                  "has a dim 1: token micro-batches need (rows, length) inputs")
        length, lengths = int(values[at].shape[1]), given.tolist()
    if given is not None:
        _agree(given, lengths, length, mask is not None)
    if len(lengths) < chunks:
        raise MicroBatchError(
            f"cannot split a batch of {len(lengths)} rows into {chunks} micro-batches: use "
            f"chunks <= {len(lengths)} (for inference on a small batch, pipe(x, "
            f"chunks={len(lengths)})) or a larger batch")
    assert at is not None
    trim = positions.trimmed(at) if positions is not None else None
    layouts = positions.layouts(at, outputs) if positions is not None and trim else None
    groups = group(lengths, chunks)
    # Trim to at least 2 (or the whole length): an exported graph's symbolic sizes start at 2.
    trimmed = [min(length, max(2, max(lengths[r] for r in g))) for g in groups]
    if layouts is None and len(set(trimmed)) == 1 and trimmed[0] < length:
        # No graph says which outputs run along the positions: their sizes will, if the
        # micro-batches have two lengths at least (token_outputs.py). One more position in
        # the last group (or none trimmed, for one group) costs little and changes no value.
        trimmed[-1] = trimmed[-1] + 1 if len(groups) > 1 else length
    shapes = [(len(g), n) for g, n in zip(groups, trimmed, strict=True)]
    train = program is None or any(a.op in (Op.B, Op.I, Op.W) for a in program.actions[0])
    costs = ((measured.predict(shapes, train) if measured is not None else None)
             or [float(rows * max(n, 1)) for rows, n in shapes])  # before any measurement
    ordered = order(costs, program)
    return Cut(len(lengths), length, tuple(tuple(groups[k]) for k in ordered),
               tuple(shapes[k][1] for k in ordered), trim, layouts)


def check_model(modules: Sequence[nn.Module]) -> None:
    """Rows must be independent: BatchNorm's statistics over a trimmed micro-batch differ."""
    for root in modules:
        for name, m in root.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                raise PipeConfigError(
                    f"tokens= trims micro-batches to their longest row, but the model holds "
                    f"BatchNorm ({name or type(m).__name__}: {type(m).__name__}), whose "
                    f"statistics mix rows and positions, so trimming would change them: train "
                    f"it without tokens= (micro-batches cut by rows)")


def check_labels(cut: Cut, value: Any, what: str) -> None:
    """Labels (integer, (rows, length, ...)) count nothing where a row is trimmed: a token
    counted on padding would be cut away, and the loss would no longer be the batch's."""
    for v in as_tuple(value):
        if not (isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == cut.rows
                and v.shape[1] == cut.length) or v.is_floating_point() or v.dtype == torch.bool:
            continue
        for g, n in zip(cut.groups, cut.lengths, strict=True):
            rest = v[list(g), n:]
            if bool((rest != PADDING).any()):
                row = g[int((rest != PADDING).flatten(1).any(1).nonzero()[0])]
                raise PipeConfigError(
                    f"tokens= trims padding away, but the {what} counts a token on row {row}'s "
                    f"padding (a label other than {PADDING} past its {n} tokens): label "
                    f"padding {PADDING}, so the loss counts only what is kept")


def cut_batch(x: Any, target: Any, chunks: int, tokens: Any,
              names: Sequence[str] | None = None, program: Schedule | None = None,
              measured: TokenCosts | None = None, positions: Positions | None = None,
              outputs: Sequence[str] = ()) -> Cut:
    """`plan`, with the labels (a model's `labels` input where it is trimmed, and the
    target) checked."""
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in as_tuple(x)):
        raise PipeConfigError("tokens= trims the inputs, so their gradients could not be "
                              "handed back row for row: pass inputs that do not require grad, "
                              "or train without tokens=")
    cut = plan(x, chunks, tokens, names, program, measured, positions, outputs)
    if names is not None:
        for i, (name, v) in enumerate(zip(names, as_tuple(x), strict=False)):
            # A seq2seq model's labels have the decoder's length: not trimmed, not checked.
            if name in LABEL_NAMES and (cut.trim is None or i in cut.trim):
                check_labels(cut, v, f"input {name!r}")
    if target is not None:
        check_labels(cut, target, "target")
        _check_shifted(cut, target)
    return cut


def _check_shifted(cut: Cut, target: Any) -> None:
    """Labels one position shorter than the inputs (shifted outside the loss) are not
    trimmed with them: beside trimmed logits the loss fails at the last stage."""
    for v in as_tuple(target):
        if (isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == cut.rows
                and v.shape[1] == cut.length - 1 and not v.is_floating_point()
                and v.dtype != torch.bool):
            raise PipeConfigError(
                f"tokens= trims the target with the inputs where its dim 1 is their length, "
                f"but the target has shape {tuple(v.shape)} beside the inputs' "
                f"{(cut.rows, cut.length)}: one position shorter (labels shifted outside "
                f"the loss), it would stay whole beside the trimmed outputs. Pass labels as "
                f"long as the inputs (input_ids, -100 on padding) and shift them inside the "
                f"loss, as Hugging Face's models do")


def cuts(pipe: Any, pairs: Sequence[tuple[Any, Any]], tokens: Any, chunks: int
         ) -> list[Cut | None]:
    """Each batch's cut on this rank (None: rows split evenly), with `tokens` the step's
    setting (None: the Pipe's). A rank that needs no input gets None; one holding the last
    stage needs `x` to cut its target the same way."""
    tokens = getattr(pipe, "_tokens", None) if tokens is None else tokens
    measured = _measure(pipe)
    if tokens is None or tokens is False:
        return [None] * len(pairs)
    check_model([pipe, *([pipe._io] if pipe._io is not None else [])])
    last = len(pipe.balance) - 1
    io = pipe._io
    names = list(io.input_names) if io is not None else None
    # A model split from its graph: which inputs and outputs run along the positions.
    positions = io.positions.get(io.mode) if io is not None else None
    outputs = (paths(io.out_specs[io.mode], io.scalars[io.mode].num_leaves)
               if positions is not None else ())
    program = pipe.program(chunks)
    out: list[Cut | None] = []
    for x, target in pairs:
        if x is None:
            if last in pipe.local_stages and target is not None:
                raise PipeConfigError(
                    f"rank {pipe.world[0] if pipe.world else 0} holds the last stage, and "
                    f"tokens= cuts its target as the input's rows are cut: pass x on this "
                    f"rank too (only ranks without the first and last stage may pass None)")
            out.append(None)
            continue
        # Over processes the ranks add their fits only when the Pipe cuts every step (built
        # with tokens=): else each rank's own fit could order the micro-batches its own way.
        out.append(cut_batch(x, target, chunks, tokens, names, program,
                             measured if not pipe.world or pipe._tokens else None,
                             positions, outputs))
    pipe.__dict__["_token_step"] = (pipe._timeline, [
        (len(g), n) for c in out if c is not None for g, n in zip(c.groups, c.lengths,
                                                                   strict=True)], chunks)
    return out


def _measure(pipe: Any) -> TokenCosts:
    """The Pipe's fitted micro-batch costs, the last token step's measurement added (its
    timeline is the Pipe's last unless that step failed). Over processes the ranks add their
    fits when the Pipe was built with `tokens=` (then every rank calls this at every step)."""
    measured: TokenCosts = pipe.__dict__.setdefault("_token_costs", TokenCosts())
    last = pipe.__dict__.pop("_token_step", None)
    if last is not None:
        before, shapes, chunks = last
        if pipe._timeline is not None and pipe._timeline is not before and shapes:
            measured.record(pipe._timeline, shapes, chunks)
        if pipe.world and getattr(pipe, "_tokens", None):
            measured.agree(pipe._executor.exchange)
    return measured


def padded(cut: Cut | None, outputs: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """`pipe(x)`'s micro-batch outputs, padded back to the batch's length under a cut."""
    return outputs if cut is None else cut.pad(outputs)


def restored(cut: Cut | None, value: Any) -> Any:
    """`pipe(x)`'s output with its rows in the caller's order under a cut."""
    return value if cut is None else cut.restore(value)


def _find_mask(values: Sequence[Any], names: Sequence[str] | None) -> int | None:
    """Which entry of `values` is the attention mask, if any."""
    if names is not None:
        at = list(names).index(MASK_NAME) if MASK_NAME in names else None
        return at if at is not None and at < len(values) and isinstance(
            values[at], torch.Tensor) else None
    if len(values) >= 2 and all(isinstance(v, torch.Tensor) for v in values[:2]):
        ids, mask = values[0], values[1]
        assert isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor)
        if mask.dim() == 2 and mask.shape == ids.shape[:2]:
            return 1  # an (ids, mask) tuple
    return None


def _trailing(mask: torch.Tensor) -> list[int]:
    """Each row's tokens, from a mask of trailing padding (ones, then zeros); refused else."""
    m = mask.detach().cpu()
    if not bool(((m == 0) | (m == 1)).all()):
        raise PipeConfigError(f"tokens= reads row lengths from the attention mask, which must "
                              f"hold 0 and 1 (got values {sorted(set(m.flatten().tolist()))[:5]})"
                              f": pass a 0/1 mask, or tokens=lengths")
    m = m.to(torch.int64)
    rising = (m[:, 1:] > m[:, :-1]).nonzero()
    if len(rising):
        row, col = int(rising[0, 0]), int(rising[0, 1])
        raise PipeConfigError(
            f"tokens= trims each micro-batch at its rows' trailing padding, but row {row}'s "
            f"attention mask is 0 at position {col} and 1 at {col + 1} (left padding, or a "
            f"hole): pad on the right (a tokenizer's padding_side='right'), or train without "
            f"tokens=")
    return [int(n) for n in m.sum(1).tolist()]


def _agree(given: torch.Tensor, lengths: list[int], length: int, from_mask: bool) -> None:
    if given.numel() != len(lengths):
        raise PipeConfigError(f"tokens=lengths needs one length per row: got {given.numel()} "
                              f"for {len(lengths)} rows")
    for row, (a, b) in enumerate(zip(given.tolist(), lengths, strict=True)):
        if from_mask and int(a) != b:
            raise PipeConfigError(
                f"tokens=lengths disagrees with the attention mask on row {row}: length {a}, "
                f"but the mask counts {b} tokens; pass the mask's lengths (mask.sum(1)) or "
                f"tokens=True to read them from it")
        if not 0 <= int(a) <= length:
            raise PipeConfigError(f"tokens=lengths gives row {row} length {a}, outside the "
                                  f"batch's padded length 0..{length}")
