"""Hypothesis strategies shared by the test suite."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import strategies as st

import schedules
from schedules import Action, Op, Schedule

__all__ = [
    "FILE_KINDS",
    "GATE_FILE_KINDS",
    "GATE_READERS",
    "METADATA_FIELDS",
    "auto_costs",
    "auto_problems",
    "balances",
    "crafted_checkpoints",
    "gate_inputs",
    "microbatch_costs",
    "model_profiles",
    "mutated_schedules",
    "padded_labels",
    "quorum_scripts",
    "schedule_args",
    "schedules_any",
    "sequential_specs",
    "stage_graphs",
    "sync_programs",
    "synthetic_profile",
    "traced_pipes",
    "wire_headers",
    "wire_values",
]

ranks = st.integers(1, 8)
microbatches = st.integers(1, 32)


@st.composite
def schedule_args(draw: st.DrawFn, name: str | None = None) -> tuple[str, int, int, dict[str, int]]:
    """(name, num_ranks, num_microbatches, options) for any registered generator."""
    name = name or draw(st.sampled_from(schedules.available()))
    gen = schedules.info(name)
    options: dict[str, int] = {}
    if gen.stages_option is not None:
        options[gen.stages_option] = draw(st.integers(gen.stages_per_rank, 4))
    if gen.batches_option is not None:
        options[gen.batches_option] = draw(st.integers(1, 3))
    return name, draw(ranks), draw(microbatches), options


def schedules_any(name: str | None = None) -> st.SearchStrategy[Any]:
    """A generated schedule of any registered generator (or of `name`)."""
    return schedule_args(name).map(lambda a: schedules.get_schedule(a[0], a[1], a[2], **a[3]))


@st.composite
def auto_costs(draw: st.DrawFn, num_ranks: int,
               num_microbatches: int) -> tuple[Any, int | None]:
    """(costs, memory_limit) for `schedules.auto.search` at p x m: unequal per-stage F, I
    and W (in quarters, 0.25 to 4, so a head may cost 16 blocks), B = I + W, a transfer time
    of 0 to 1 and a memory limit of 1 to m micro-batches per rank, or none."""
    p = num_ranks
    quarters = st.lists(st.integers(1, 16).map(lambda q: q / 4), min_size=p, max_size=p)
    f, i, w = draw(quarters), draw(quarters), draw(quarters)
    costs = schedules.Costs(forward=f, backward_input=i, backward_weight=w,
                            backward=[a + b for a, b in zip(i, w, strict=True)],
                            comm=draw(st.integers(0, 4)) / 4)
    return costs, draw(st.none() | st.integers(1, num_microbatches))


@st.composite
def auto_problems(draw: st.DrawFn, max_ranks: int = 4,
                  max_microbatches: int = 12) -> tuple[int, int, Any, int | None]:
    """(num_ranks, num_microbatches, costs, memory_limit): p of 2 to `max_ranks`, m of 1 to
    `max_microbatches`, and `auto_costs` for them."""
    p = draw(st.integers(2, max_ranks))
    m = draw(st.integers(1, max_microbatches))
    costs, limit = draw(auto_costs(p, m))
    return p, m, costs, limit


@st.composite
def sync_programs(draw: st.DrawFn) -> Schedule:
    """A generated schedule (any generator, small) made a program with random syncs: random
    ties (an owner stage and later copy stages), dp on or off, a scaler or not."""
    name, num_ranks, num_microbatches, options = draw(schedule_args())
    plain = schedules.get_schedule(name, min(num_ranks, 4), min(num_microbatches, 6),
                                   **options)
    n = plain.num_stages
    ties = []
    if n > 1:
        for _ in range(draw(st.integers(0, 3))):
            owner = draw(st.integers(0, n - 2))
            copies = draw(st.sets(st.integers(owner + 1, n - 1), min_size=1, max_size=3))
            ties.append((owner, sorted(copies)))
    syncs = schedules.Syncs.of(ties, dp=draw(st.booleans()), scaler=draw(st.booleans()))
    return schedules.program(plain, syncs)


@st.composite
def microbatch_costs(draw: st.DrawFn, schedule: Schedule, scaled: bool = True) -> Any:
    """`schedules.Costs` for `schedule` with per micro-batch scales (the tokens cut's, as many
    as its micro-batches or not; none where not `scaled`), every other term flat or per stage
    (sometimes one stage short: an error where it is needed), from 0 up."""
    n = max(schedule.num_stages - (draw(st.integers(0, 9)) == 0), 0)
    quarters = st.integers(0, 16).map(lambda q: q / 4)
    terms = quarters | st.lists(quarters, min_size=n, max_size=n)
    scales = st.lists(st.integers(0, 40).map(lambda q: q / 8), min_size=1,
                      max_size=schedule.total_microbatches + 1)
    return schedules.Costs(
        forward=draw(terms), backward=draw(terms), backward_input=draw(quarters),
        backward_weight=draw(quarters), update=draw(quarters), comm=draw(quarters),
        tie=draw(terms), reduce_grad=draw(terms), overflow=draw(quarters),
        microbatch=draw(scales) if scaled else ())


_EDITS = ("swap", "move", "drop", "copy", "microbatch", "stage", "op")


@st.composite
def mutated_schedules(draw: st.DrawFn) -> Schedule:
    """A generated schedule, lowered or not, after up to three random edits (swap two actions of
    a rank, move one to another rank, drop one, copy one, change its micro-batch, stage or op):
    valid, incomplete, misplaced, repeated, out of range, out of order or deadlocking."""
    schedule = draw(schedules_any())
    if draw(st.booleans()):
        schedule = schedules.lower(schedule)
    rows = [list(row) for row in schedule.actions]
    for _ in range(draw(st.integers(0, 3))):
        edit = draw(st.sampled_from(_EDITS))
        r = draw(st.integers(0, len(rows) - 1))
        if not rows[r]:
            continue
        i = draw(st.integers(0, len(rows[r]) - 1))
        a = rows[r][i]
        other = draw(st.integers(0, len(rows) - 1))
        at = draw(st.integers(0, len(rows[other])))
        if edit == "swap":
            j = draw(st.integers(0, len(rows[r]) - 1))
            rows[r][i], rows[r][j] = rows[r][j], a
        elif edit in ("move", "drop"):
            del rows[r][i]
            if edit == "move":
                rows[other].insert(min(at, len(rows[other])), a)
        elif edit == "copy":
            rows[other].insert(at, a)
        else:
            stage, op, mb = a.stage, a.op, a.microbatch
            if edit == "microbatch":
                mb = draw(st.integers(0, schedule.total_microbatches))
            elif edit == "stage":
                stage = draw(st.integers(0, schedule.num_stages))
            else:
                op = draw(st.sampled_from(list(Op)))
            rows[r][i] = Action(stage, op, mb, a.version)
    return schedule.replace(actions=tuple(map(tuple, rows)))


@st.composite
def sequential_specs(draw: st.DrawFn, *, dropout: bool = True) -> dict[str, Any]:
    """A random nn.Sequential recipe: layer kinds and widths, a batch size and a chunk count."""
    width = draw(st.integers(1, 64))
    kinds = ["linear", "gelu", "tanh", "layernorm"] + (["dropout"] if dropout else [])
    depth = draw(st.integers(2, 12))
    current = draw(st.integers(1, 64))
    layers: list[tuple[str, int]] = [("linear", current)]
    for _ in range(depth - 1):
        kind = draw(st.sampled_from(kinds))
        if kind == "layernorm" and current <= 2:
            # LayerNorm over one feature outputs rounding noise divided by sqrt(eps); over two
            # it outputs +-1 whatever the input, so the gradient it passes back is zero in exact
            # arithmetic and rounding noise in any evaluation order: no tolerance can compare
            # the gradients of the layers before it.
            kind = "tanh"
        if kind == "linear":
            current = draw(st.integers(1, 64))
        layers.append((kind, current if kind == "linear" else 0))
    chunks = draw(st.integers(1, 8))
    batch = draw(st.integers(chunks, 3 * chunks + 2))  # often not a multiple: uneven chunks
    return {"in": width, "layers": layers, "chunks": chunks, "batch": batch,
            "seed": draw(st.integers(0, 2**16))}


@st.composite
def stage_graphs(draw: st.DrawFn) -> dict[str, Any]:
    """A random graph of values flowing through a stack of layers (tests/models_graphs.py
    builds it): each layer rewrites some of a few slots from others, from the batch's integer
    ids (a side input, as token ids), from its parameters alone (a branch that never meets the
    layer's incoming activations, as a position embedding or an encoder's output crossing to a
    decoder), or by copying a slot (one value returned twice). Parameters come from a small
    shared pool, so one may serve several layers (tied across stages) or one layer twice. Slots a
    layer leaves alone cross it unchanged, so a value can cross several stages."""
    slots = draw(st.integers(1, 3))
    pool = draw(st.integers(1, 4))
    slot, param = st.integers(0, slots - 1), st.integers(0, pool - 1)
    op = st.one_of(
        st.tuples(st.just("linear"), slot, slot, param),  # dst = tanh(src @ W)
        st.tuples(st.just("embed"), slot, param),  # dst += W[ids]: a side input's branch
        st.tuples(st.just("fresh"), slot, param),  # dst = W's rows summed: parameters alone
        st.tuples(st.just("mul"), slot, slot, slot),  # dst = a * b
        st.tuples(st.just("add"), slot, slot, slot),  # dst = a + b
        st.tuples(st.just("copy"), slot, slot),  # dst = src, the same tensor
    )
    layers = draw(st.lists(st.lists(op, max_size=4), min_size=2, max_size=6))
    layers[-1].append(("linear", 0, 0, draw(param)))  # the loss depends on some parameter
    chunks = draw(st.integers(1, 4))
    return {"slots": slots, "pool": pool, "width": draw(st.integers(1, 4)), "layers": layers,
            "chunks": chunks, "rows": draw(st.integers(chunks, 2 * chunks + 1)),
            "seed": draw(st.integers(0, 2**16))}


@st.composite
def balances(draw: st.DrawFn, num_layers: int, num_stages: int) -> list[int]:
    """A random split of `num_layers` into `num_stages` non-empty contiguous stages."""
    cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=num_stages - 1,
                                max_size=num_stages - 1, unique=True)))
    edges = [0, *cuts, num_layers]
    return [b - a for a, b in itertools.pairwise(edges)]


def synthetic_profile(layer_costs: list[tuple[float, float, float]], batch: int, *,
                      overhead: float = 1e-4) -> Any:
    """A `ModelProfile` without a model: per layer (seconds per row, bytes per row saved,
    parameter bytes); every micro-batch size costs `overhead` + rows x seconds per row in
    forward (twice that in backward, split evenly into I and W) and holds its input (4 bytes
    a row per layer) and rows x its saved bytes. Profiled at every size 1..batch."""
    from pipeline.planner import LayerCosts, ModelProfile

    by_rows = {}
    for r in range(1, batch + 1):
        forward = tuple(overhead + r * t for t, _, _ in layer_costs)
        by_rows[r] = LayerCosts(r, forward, tuple(2 * f for f in forward), forward, forward,
                                tuple(4.0 * r for _ in layer_costs),
                                tuple(r * g for _, g, _ in layer_costs))
    params = tuple(((i, int(p), True),) for i, (_, _, p) in enumerate(layer_costs))
    return ModelProfile(len(layer_costs), params, (0,) * len(layer_costs), by_rows, batch)


@st.composite
def model_profiles(draw: st.DrawFn, max_layers: int = 8) -> Any:
    """A synthetic `ModelProfile` of 2..max_layers layers, uneven in time, memory and size."""
    n = draw(st.integers(2, max_layers))
    costs = [(draw(st.floats(1e-5, 1e-3)), float(draw(st.integers(0, 4096))),
              float(draw(st.integers(0, 1 << 16)))) for _ in range(n)]
    return synthetic_profile(costs, draw(st.sampled_from([1, 2, 4, 8])),
                             overhead=draw(st.sampled_from([0.0, 1e-5, 1e-4])))


def full_sharding(profile: Any, collectives: int = 1, share: float = 1.0) -> Any:
    """A `TensorSharding` splitting every layer of a synthetic profile: all its parameters,
    `share` of its time and saved bytes, `collectives` all-reduces each way per layer."""
    from pipeline.planner import TensorSharding

    n = profile.num_layers
    keys = frozenset(key for layer in profile.params for key, _, _ in layer)
    return TensorSharding(keys, (share,) * n, (share,) * n, (collectives,) * n,
                          (collectives,) * n)


@st.composite
def sharded_profiles(draw: st.DrawFn, max_layers: int = 6) -> Any:
    """A synthetic profile (`model_profiles`) and a sharding of it: each layer split or not,
    with 0..2 all-reduces each way, and a share of its time and activations split."""
    from pipeline.planner import TensorSharding

    profile = draw(model_profiles(max_layers))
    n = profile.num_layers
    split = [draw(st.booleans()) for _ in range(n)]
    share = draw(st.sampled_from([0.5, 0.9, 1.0]))
    keys = frozenset(key for i, layer in enumerate(profile.params) if split[i]
                     for key, _, _ in layer)
    counts = tuple(draw(st.integers(0, 2)) if split[i] else 0 for i in range(n))
    return profile, TensorSharding(keys, tuple(share if c else 0.0 for c in split),
                                   tuple(share if c else 0.0 for c in split), counts, counts,
                                   None, draw(st.booleans()))


@st.composite
def padded_labels(draw: st.DrawFn, vocab: int, context: int) -> Any:
    """Token labels (rows x context) with -100 where a position is not counted: rows of
    padding at the end of a random length (none, all, some), or ignored positions anywhere,
    so micro-batches hold different numbers of counted tokens, sometimes none at all; at
    least one token of the batch counts (a batch of none is a test of its own)."""
    import torch

    rows = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    labels = torch.randint(0, vocab, (rows, context), generator=torch.Generator().manual_seed(seed))
    for r in range(rows):
        if draw(st.booleans()):  # right padding, as a tokenizer pads
            labels[r, draw(st.sampled_from([0, context, *range(1, context)])):] = -100
        else:  # scattered: masked prompts, dropped tokens
            mask = draw(st.lists(st.booleans(), min_size=context, max_size=context))
            labels[r, torch.tensor(mask)] = -100
    if not (labels != -100).any():
        labels[draw(st.integers(0, rows - 1)), draw(st.integers(0, context - 1))] = 0
    return labels


@st.composite
def traced_pipes(draw: st.DrawFn, blocks: list[str]) -> dict[str, Any]:
    """A Pipe over a model split from its graph at some of its `blocks` (module names in run
    order; the first begins the first stage, so never a split point): schedule, recomputation
    mode, chunks (1 to 8) and one "cpu" device per rank. Interleaved and zb-v hold two stages
    per rank, so they draw an odd number of split points (2 or 4 stages on 1 or 2 ranks)."""
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]))
    points = blocks[1:]
    per_rank = 2 if schedule in ("interleaved", "zb-v") else 1
    count = draw(st.sampled_from([n for n in range(1, len(points) + 1)
                                  if (n + 1) % per_rank == 0]))
    chosen = sorted(draw(st.lists(st.integers(0, len(points) - 1), min_size=count,
                                  max_size=count, unique=True)))
    return {"schedule": schedule,
            "checkpoint": draw(st.sampled_from(["never", "except_last", "always"])),
            "chunks": draw(st.integers(1, 8)),
            "split_points": [points[i] for i in chosen],
            "devices": ["cpu"] * ((count + 1) // per_rank)}


_WIRE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint8", "bool", "complex64")


@st.composite
def wire_values(draw: st.DrawFn) -> tuple[Any, ...]:
    """What a stage may send between processes: a tuple (or a Packed one) of 1 to 4 small
    tensors of any supported dtype and rank (0 to 3 dimensions, empty ones too) or None."""
    import torch

    from pipeline.runtime.microbatch import Packed

    values: list[Any] = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 4)) == 0:
            values.append(None)
            continue
        dtype = getattr(torch, draw(st.sampled_from(_WIRE_DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        t = torch.randint(0, 2, shape).to(dtype)
        values.append(t.requires_grad_() if draw(st.booleans()) and t.is_floating_point() else t)
    return Packed(values) if draw(st.booleans()) else tuple(values)


# Slot values a hostile or broken peer might write: out of every range, at every edge.
_SLOTS = st.one_of(st.integers(-3, 70), st.sampled_from(
    [-(1 << 63), (1 << 63) - 1, -(1 << 31), 1 << 31, 1 << 40, 1 << 62]))


@st.composite
def wire_headers(draw: st.DrawFn) -> tuple[tuple[Any, ...] | None, list[int]]:
    """(values, header): the zero-padded int64 header slots of a message `describe` made
    for `values`, or (None, header) for one after up to four random edits (a slot set to an
    edge value, slots dropped or inserted) or random slots throughout."""
    from pipeline.comm.wire import HEADER, describe

    if draw(st.integers(0, 5)) == 0:
        return None, draw(st.lists(_SLOTS, min_size=HEADER, max_size=HEADER))
    values = draw(wire_values())
    slots = list(describe(values))
    edits = draw(st.integers(0, 4))
    for _ in range(edits):
        at = draw(st.integers(0, len(slots) - 1))
        edit = draw(st.sampled_from(("set", "set", "drop", "insert")))
        if edit == "set":
            slots[at] = draw(_SLOTS)
        elif edit == "drop" and len(slots) > 1:
            del slots[at]
        elif edit == "insert":
            slots.insert(at, draw(_SLOTS))
    header = (slots + [0] * HEADER)[:HEADER]
    return (values if edits == 0 else None), header


# -- crafted checkpoint files (tests/pipeline/state/test_shard_reader.py) -------------------------
# Values a crafted `.metadata` may hold where DCP's own has something else: wrong types, sizes
# out of range, names that leave the directory or that no file system accepts.
_odd_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["", ".", "..", "../x.distcp", "/etc/passwd", "a/b", "\x00", "x\x00y",
                     ".metadata", "__0_0.distcp", "12"]),
    st.binary(max_size=8), st.lists(st.integers(-3, 3), max_size=3),
    st.tuples(st.integers(-3, 2**40), st.integers(-3, 3)),
    st.dictionaries(st.integers(-2, 2), st.integers(), max_size=2),
)
METADATA_FIELDS = ("metadata", "state_dict_metadata", "storage_data", "storage_meta", "version",
                   "planner_data", "entry", "key", "size", "chunks", "chunk.offsets",
                   "chunk.sizes", "properties", "index", "index.fqn", "index.offset",
                   "relative_path", "offset", "length", "transform_descriptors")
FILE_KINDS = ("regular", "cut", "garbage", "empty", "fifo", "directory", "symlink-inside",
              "symlink-outside", "absent")


@st.composite
def crafted_checkpoints(draw: st.DrawFn) -> dict[str, Any]:
    """How to damage a saved checkpoint: `mutations` of its metadata ((field, value) pairs,
    fields from METADATA_FIELDS) and the kind each of `.metadata` and the shard file becomes
    (one of FILE_KINDS: 'regular' keeps the file, with the mutations in `.metadata`)."""
    return {
        "mutations": draw(st.lists(st.tuples(st.sampled_from(METADATA_FIELDS), _odd_values),
                                   max_size=3)),
        "metadata": draw(st.sampled_from(FILE_KINDS)),
        "shard": draw(st.sampled_from(FILE_KINDS)),
    }


# What a reader behind the file gate may find at its path (tests/test_file_gate.py builds it):
# text of any script, bytes, nesting far past any parser's recursion, a size past the
# reader's bound, special files, links that dangle or loop, and a link (of ours) at a
# component of the path.
GATE_READERS = ("checkpoint metadata", "time model", "schedule csv", "plan memory")
GATE_FILE_KINDS = ("text", "bytes", "deep", "large", "fifo", "directory", "device link",
                   "dangling link", "link loop", "linked component")


@st.composite
def gate_inputs(draw: st.DrawFn) -> dict[str, Any]:
    """A `reader` (one of GATE_READERS) and what it finds: `kind` (GATE_FILE_KINDS), `text` or
    `data` for the content kinds, `depth` for 'deep', `component` (0 or 1) for a link."""
    return {"reader": draw(st.sampled_from(GATE_READERS)),
            "kind": draw(st.sampled_from(GATE_FILE_KINDS)),
            "text": draw(st.text(max_size=64)), "data": draw(st.binary(max_size=64)),
            "depth": draw(st.integers(1, 200_000)), "component": draw(st.integers(0, 1))}


QUORUM_REPLICAS = ("r0", "r1", "r2", "r3")


@st.composite
def quorum_scripts(draw: st.DrawFn) -> dict[str, Any]:
    """A lighthouse's life: `min_replicas` and rounds; in each round the replicas that
    heartbeat (the others stop: they leave), whether time passes first (long enough for the
    leavers' heartbeats to expire), and the replicas that ask for a quorum, in order, each
    with its step, world size and shrink_only."""
    rounds = []
    for _ in range(draw(st.integers(1, 4))):
        alive = draw(st.lists(st.sampled_from(QUORUM_REPLICAS), unique=True, max_size=4))
        order = draw(st.permutations(sorted(alive)))
        joiners = order[:draw(st.integers(0, len(order)))]
        joins = [{"replica_id": rid, "step": draw(st.integers(0, 3)),
                  "world_size": draw(st.integers(1, 3)),
                  "shrink_only": draw(st.booleans()) and draw(st.booleans())}
                 for rid in joiners]
        rounds.append({"alive": sorted(alive), "expire": draw(st.booleans()), "joins": joins})
    return {"min_replicas": draw(st.integers(1, 2)), "rounds": rounds}


@st.composite
def tied_profiles(draw: st.DrawFn) -> Any:
    """A synthetic `ModelProfile` of 4, 6 or 8 equal layers: schedules that split it alike
    predict steps within a fraction of a percent of each other (near ties)."""
    n = draw(st.sampled_from([4, 6, 8]))
    seconds = draw(st.floats(1e-5, 1e-3))
    return synthetic_profile([(seconds, 1024.0, 4096.0)] * n, 8,
                             overhead=draw(st.sampled_from([0.0, 1e-5, 1e-4])) * seconds / 1e-4)


@st.composite
def noisy_profiles(draw: st.DrawFn, profile: Any, spread: float) -> Any:
    """`profile` with every cost (each layer, kind and micro-batch size) times its own factor
    in [1 - spread, 1 + spread]: a profile of the same model taken again."""
    from dataclasses import replace

    def noisy(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v * draw(st.floats(1 - spread, 1 + spread)) for v in values)

    by_rows = {r: replace(c, forward=noisy(c.forward), backward=noisy(c.backward),
                          backward_input=noisy(c.backward_input),
                          backward_weight=noisy(c.backward_weight))
               for r, c in profile.by_rows.items()}
    return replace(profile, by_rows=by_rows)
