"""Tensor parallelism in the planner: what a tp plan splits, and a profile as one tp rank sees it.

The model of a layer under tp = t (Megatron-LM's, Shoeybi et al. 2019 and Narayanan et al.
2021), per micro-batch:

- compute: the share of the layer's profiled time that tp splits (`split_time`, 1 for a layer
  the plan covers) is divided by t. This assumes the t shards run at the whole layer's speed
  per FLOP; smaller matrices run less efficiently, so it is optimistic for large t on small
  layers.
- collectives: each all-reduce of `message` bytes over the t ranks of one host costs what the
  host link's ring all-reduce costs, 2(t-1) steps of latency + message/t bytes, and is part of
  the forward (after each row-parallel module) or of the backward's input gradient (before the
  column-parallel ones): nothing overlaps it. With sequence parallelism the all-reduce becomes a
  reduce-scatter and an all-gather of the same bytes, so the same cost.
- memory: the parameters tp splits (`split_params`), and their gradients and optimizer state,
  are divided by t; so is the split share of the saved activations (`split_saved`); the stage
  input is whole on every tp rank, unless sequence parallelism splits it too.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from pipeline.errors import PipeConfigError, PipeTypeError
from pipeline.planner.costs import LayerCosts, ModelProfile, parameter_keys
from pipeline.planner.link import Link

__all__ = ["REPLICATED_ACTIVATIONS", "TensorSharding", "mesh_shapes", "shard_profile",
           "sharding_of", "style_kind"]

# Without sequence parallelism a transformer block keeps 10 of its 34 bytes of activations per
# token and hidden unit whole on every tp rank (its layer norms' inputs, dropout masks and the
# residual stream; the attention scores, split by head, left out): Korthikanti et al. 2022,
# "Reducing Activation Recomputation in Large Transformer Models", section 4.2.
REPLICATED_ACTIVATIONS = 10 / 34


@dataclass(frozen=True)
class TensorSharding:
    """How tensor parallelism splits each layer of a profiled model (see the module's notes).

    `split_params`: the `ModelProfile.params` keys of the parameters split over the tp ranks.
    Per layer: `split_time`, the share of its compute that tp divides (0: the layer runs whole
    on every tp rank); `split_saved`, the share of its saved activations divided;
    `forward_collectives` / `backward_collectives`, all-reduces per micro-batch in its forward
    and in its backward; `message_bytes`, each all-reduce's bytes per row of the micro-batch
    (None: the layer's input bytes, a transformer block's hidden state). `sequence_parallel`:
    every layer's input but the first is split over the tp ranks too.
    """

    split_params: frozenset[int]
    split_time: tuple[float, ...]
    split_saved: tuple[float, ...]
    forward_collectives: tuple[int, ...]
    backward_collectives: tuple[int, ...]
    message_bytes: tuple[float | None, ...] | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        n = len(self.split_time)
        per_layer: dict[str, Sequence[float | None]] = {
            "split_saved": self.split_saved, "forward_collectives": self.forward_collectives,
            "backward_collectives": self.backward_collectives}
        if self.message_bytes is not None:
            per_layer["message_bytes"] = self.message_bytes
        for name, values in per_layer.items():
            if len(values) != n:
                raise PipeConfigError(f"TensorSharding.{name} needs one value per layer: "
                                      f"{n} layers (split_time), got {len(values)}")
        for name in ("split_time", "split_saved"):
            if any(not 0.0 <= v <= 1.0 for v in getattr(self, name)):
                raise PipeConfigError(f"TensorSharding.{name} holds shares between 0 and 1 "
                                      f"(got {list(getattr(self, name))})")
        counts = (*self.forward_collectives, *self.backward_collectives)
        messages = [m for m in self.message_bytes or () if m is not None]
        if any(c < 0 for c in counts) or any(m < 0 for m in messages):
            raise PipeConfigError("TensorSharding's collective counts and message bytes must "
                                  "be >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.split_time)

    def message(self, layer: int, costs: LayerCosts) -> float:
        """Bytes of one all-reduce of `layer` for micro-batches of `costs.rows` rows."""
        given = self.message_bytes[layer] if self.message_bytes is not None else None
        return costs.input_bytes[layer] if given is None else given * costs.rows


def style_kind(style: Any) -> str | None:
    """'col', 'row' or 'seq' for a torch `ParallelStyle` (`ColwiseParallel`, `RowwiseParallel`,
    `SequenceParallel`, by class name, so subclasses and look-alikes count) or its name as
    Hugging Face's tp plans write it ('colwise', 'rowwise', 'sequence_parallel'); None for
    styles that split nothing (`PrepareModuleInput`, ...)."""
    name = (style if isinstance(style, str) else type(style).__name__).lower()
    for key, kind in (("colwise", "col"), ("rowwise", "row"), ("sequence", "seq")):
        if key in name:
            return kind
    if isinstance(style, str):
        raise PipeConfigError(f"tp_plan style {style!r} is not one the planner knows: use a "
                              f"torch ParallelStyle (ColwiseParallel(), RowwiseParallel(), "
                              f"SequenceParallel()) or 'colwise', 'rowwise', "
                              f"'sequence_parallel'")
    return None


def _matches(pattern: str, name: str) -> bool:
    # As torch's parallelize_module reads a plan: dot-separated atoms, each an fnmatch pattern.
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a)
                                            for a, p in zip(atoms, parts, strict=True))


def sharding_of(model: nn.Sequential, tp_plan: Mapping[str, Any], *,
                replicated_activations: float | None = None) -> TensorSharding:
    """What `tp_plan` ({module-name pattern: ParallelStyle}, as `Pipe(tp_plan=...)` takes it)
    splits in each layer of `model`. A pattern matches a module's name in the model
    ('3.attn.qkv') or within its layer ('attn.qkv'). A layer with a column- or row-parallel
    module is covered: its time divides by tp; the parameters of those modules are split (a
    row-parallel module's bias stays whole); each row-parallel module adds an all-reduce in
    forward and one in backward (Megatron pairs a column-parallel region with the row-parallel
    module after it), and a layer with column-parallel modules only one in backward. Its saved
    activations are split but for `replicated_activations` (default: a transformer block's
    share, `REPLICATED_ACTIVATIONS`; 0 with a `SequenceParallel` module in the plan)."""
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise PipeTypeError(f"tp_plan must be a non-empty dict of module-name pattern -> "
                            f"ParallelStyle (got {tp_plan!r})")
    kinds = {pattern: style_kind(style) for pattern, style in tp_plan.items()}
    sequence = "seq" in kinds.values()
    keep = (0.0 if sequence else REPLICATED_ACTIVATIONS) if replicated_activations is None \
        else float(replicated_activations)
    if not 0.0 <= keep <= 1.0:
        raise PipeConfigError(f"replicated_activations is a share between 0 and 1 (got {keep})")
    keys = parameter_keys(model)
    used: set[str] = set()
    split: set[int] = set()
    time: list[float] = []
    saved: list[float] = []
    forward: list[int] = []
    backward: list[int] = []
    for i, layer in enumerate(model):
        cols = rows = 0
        for name, module in layer.named_modules():
            full = f"{i}.{name}" if name else str(i)
            for pattern, kind in kinds.items():
                if not (_matches(pattern, full) or (name and _matches(pattern, name))):
                    continue
                used.add(pattern)
                if kind not in ("col", "row"):
                    continue
                cols += kind == "col"
                rows += kind == "row"
                for pname, p in module.named_parameters(recurse=False):
                    if not (kind == "row" and pname == "bias"):
                        split.add(keys[id(p)])
        covered = bool(cols or rows)
        time.append(1.0 if covered else 0.0)
        saved.append(1.0 - keep if covered else 0.0)
        forward.append(rows)
        backward.append(rows if rows else (1 if cols else 0))
    unused = [p for p in tp_plan if p not in used]
    if unused:
        raise PipeConfigError(f"tp_plan patterns {unused} match no module of the model: a "
                              f"pattern names a module in the model ('3.attn.qkv', '*.mlp.fc1') "
                              f"or within its layer ('attn.qkv')")
    if not any(time):
        raise PipeConfigError("tp_plan splits no layer: give at least one module a "
                              "ColwiseParallel or RowwiseParallel style")
    return TensorSharding(frozenset(split), tuple(time), tuple(saved), tuple(forward),
                          tuple(backward), None, sequence)


def shard_profile(profile: ModelProfile, sharding: TensorSharding, tp: int,
                  link: Link) -> ModelProfile:
    """`profile` as each of `tp` tensor-parallel ranks sees it: the split parameters, compute
    and saved activations divided by `tp`, each layer's collectives (over `link`, the ranks'
    host link) added to its forward and to its backward's input gradient."""
    if tp == 1:
        return profile
    if sharding.num_layers != profile.num_layers:
        raise PipeConfigError(f"the tensor sharding describes {sharding.num_layers} layers, "
                              f"the profile has {profile.num_layers}")
    params = tuple(tuple((key, -(-nbytes // tp) if key in sharding.split_params else nbytes,
                          grad) for key, nbytes, grad in layer) for layer in profile.params)
    by_rows = {rows: _shard_costs(costs, sharding, tp, link)
               for rows, costs in profile.by_rows.items()}
    return ModelProfile(profile.num_layers, params, profile.buffer_bytes, by_rows,
                        profile.batch_rows, profile.device)


def _shard_costs(costs: LayerCosts, sharding: TensorSharding, tp: int,
                 link: Link) -> LayerCosts:
    f, b, bi, bw, ins, saved = [], [], [], [], [], []
    for i in range(sharding.num_layers):
        keep = 1.0 - sharding.split_time[i] * (1.0 - 1.0 / tp)
        reduce = link.allreduce(sharding.message(i, costs), tp)
        fwd, bwd = sharding.forward_collectives[i] * reduce, \
            sharding.backward_collectives[i] * reduce
        f.append(costs.forward[i] * keep + fwd)
        b.append(costs.backward[i] * keep + bwd)
        bi.append(costs.backward_input[i] * keep + bwd)
        bw.append(costs.backward_weight[i] * keep)
        ins.append(costs.input_bytes[i] / tp if sharding.sequence_parallel and i > 0
                   else costs.input_bytes[i])
        saved.append(costs.saved_bytes[i] * (1.0 - sharding.split_saved[i] * (1.0 - 1.0 / tp)))
    return LayerCosts(costs.rows, tuple(f), tuple(b), tuple(bi), tuple(bw), tuple(ins),
                      tuple(saved))


def mesh_shapes(ranks: int, batch_rows: int, dps: Sequence[int], tps: Sequence[int]
                ) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) with dp x pp x tp = `ranks`, dp dividing the batch's rows, for the
    given dp and tp sizes (tp sizes already checked to fit a host)."""
    shapes = []
    for tp in sorted(set(tps)):
        if ranks % tp:
            continue
        for dp in sorted(set(dps)):
            if (ranks // tp) % dp == 0 and batch_rows % dp == 0:
                shapes.append((dp, ranks // (tp * dp), tp))
    return shapes
