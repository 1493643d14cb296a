"""Models split from their exported graphs over 2 gloo processes (and dp x pp = 2 x 2 on 4),
against the unsplit model: GPT-2 (its head tied to the embedding across the two ranks), Llama
(grouped-query attention, rotary positions, an attention mask crossing the cut), BERT (its
decoder tied) and a U-Net (BatchNorm, skip connections over the cut). Each rank checks its own
parameters against the unsplit model it builds itself; the tests check that the ranks
together covered the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.state import sharded
from tests.limits import IN_TURN_TIMEOUT
from tests.models_lengths import length_case
from tests.pipeline import lengths_workers, tokens_workers, traced_workers
from tests.pipeline.in_turn import InTurn, in_turn, ranks
from tests.pipeline.sharded_workers import assert_same, snapshot, unpack

pytestmark = [pytest.mark.dist]
pytest.importorskip("transformers")

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
MODES = ["never", "except_last", "always"]
# GPT-2 (the tie across ranks) and Llama under every schedule once, the modes turning with
# them (each mode at least once, the two models at other modes; every schedule with every mode
# is the threads' property, tests/test_transparency.py, shared parameters included).
# BERT (its decoder tied across ranks) and the U-Net (BatchNorm; skip connections over the
# cut) under a schedule of each kind, every mode once.
COMBOS = {"gpt2": [(s, MODES[i % 3]) for i, s in enumerate(SCHEDULES)],
          "llama": [(s, MODES[(i + 1) % 3]) for i, s in enumerate(SCHEDULES)],
          "bert": [("1f1b", "always"), ("zb-v", "never"), ("gpipe", "except_last")],
          "unet": [("zb-h1", "except_last"), ("gpipe", "always"), ("1f1b", "never")]}
# (model, schedule, labels given to the model) and the batch sizes of each step in turn.
CHANGING_RUNS = [("gpt2", "1f1b", False), ("gpt2", "zb-v", True), ("llama", "zb-v", False),
                 ("llama", "1f1b", True)]
CHANGING_SIZES = [7, 5, 8, 4]
META_RUNS = [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False)]
# Captured at 12 tokens, trained at 16, 7 and 8, run at 20: each model, schedules of each kind.
LENGTH_RUNS = [("llama", "1f1b"), ("gpt2", "zb-v"), ("bert", "gpipe"), ("llama", "interleaved"),
               ("gpt2", "zb-h1")]
LENGTH_DP_RUNS = [("llama", "1f1b"), ("gpt2", "zb-h1")]
TOKEN_DP_SCHEDULES = ["1f1b", "zb-h1"]

# Every scenario on one set of 2 ranks in turn (see tests/pipeline/in_turn.py): each rank
# imports transformers and torch.export's machinery once. Each test checks its own scenario's
# results. The fixture adds the checkpoint's, in a directory of its own.
# Exporting is most of a Pipe's set-up: scenarios that split a model already exported from the
# same inputs (by the scenarios before them, or their own earlier runs) reuse that graph, and
# still export anew to capture other lengths or dtypes (`traced_workers.reusing_exports`).
reusing = traced_workers.reusing_exports
TWO_RANKS = [
    *[(name, traced_workers.train_like_the_model, (name, combos))
      for name, combos in COMBOS.items()],
    ("changing batches", reusing,
     (traced_workers.changing_batches, CHANGING_RUNS, CHANGING_SIZES)),
    ("meta", traced_workers.meta_stage, (META_RUNS,)),
    ("lengths", reusing, (lengths_workers.lengths_pp, LENGTH_RUNS, [16, 7, 8])),
    ("token micro-batches", tokens_workers.tokens_pp, (["1f1b", "zb-h1"],)),
    ("dtype", reusing, (lengths_workers.dtypes_pp, "zb-h1")),
]




@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traced")


@pytest.fixture(scope="module")
def two_ranks(checkpoint_path: Path) -> InTurn:
    return InTurn(2, [*TWO_RANKS, ("checkpoint", traced_workers.checkpoint_across_splits,
                                   (str(checkpoint_path),))], timeout=IN_TURN_TIMEOUT)


# The dp x pp = 2 x 2 scenarios, on one set of 4 ranks in turn.
FOUR_RANKS = [
    ("lengths dp", lengths_workers.lengths_dp, (LENGTH_DP_RUNS,)),
    ("token micro-batches dp", tokens_workers.tokens_dp, (TOKEN_DP_SCHEDULES,)),
]

four_ranks = ranks("four_ranks", 4, FOUR_RANKS)


@in_turn
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "unet"])
def test_trains_as_the_unsplit_model(name: str, two_ranks: InTurn) -> None:
    """`Pipe(model, example_inputs=..., split_points=...)` on 2 processes, 4 micro-batches
    (one counting no token), 3 AdamW steps: every step's loss, every gradient and the whole
    state after it equal the unsplit model's (two stages per rank for interleaved and
    zb-v, whose last stage is on rank 0)."""
    model = traced_workers.CASES[name]().model()
    every_param = {n for n, _ in model.named_parameters()}
    every_key = set(model.state_dict())
    results = two_ranks(name)
    for c, (schedule, checkpoint) in enumerate(COMBOS[name]):
        params = [set(r[c][0]) for r in results]
        keys = [set(r[c][1]) for r in results]
        what = f"{schedule}/{checkpoint}"
        # Each rank held a part of the model and checked it; together, all of it.
        assert params[0] and params[1] and not params[0] & params[1], what
        assert params[0] | params[1] == every_param, what
        assert keys[0] | keys[1] == every_key, what


@in_turn
def test_batch_sizes_that_change_between_steps(two_ranks: InTurn) -> None:
    """7, 5, 8 and 4 rows in 4 micro-batches (2-2-2-1, 2-1-1-1, 2-2-2-2, 1-1-1-1): the
    values crossing the cut change shape from step to step (a size carrier of 2 rows, then
    of 1). With the labels given to the model (its own loss, `out.loss`), an int64 input
    the first stage does not use crosses the cut to the head."""
    assert two_ranks("changing batches") == [len(CHANGING_RUNS) * len(CHANGING_SIZES)] * 2


@in_turn
def test_each_rank_materialises_only_its_stage_of_a_meta_model(two_ranks: InTurn) -> None:
    """Each rank builds the model on the meta device and traces it from meta (or real)
    inputs; Pipe gives real storage to its own stage's tensors only (GPT-2's weights come
    from `load_state_dict` after param_init="skip"; Llama's param_init computes the rotary
    tables no state_dict holds), and the Pipe then infers and trains as the unsplit model
    (checked on the ranks)."""
    results = two_ranks("meta")
    for i, (name, meta_inputs) in enumerate(META_RUNS):
        what = f"{name}, traced from {'meta' if meta_inputs else 'real'} inputs"
        case = traced_workers.CASES[name]()
        every = set(traced_workers.model_tensors(case.model()))
        ranks = [r[i] for r in results]
        for rank, found in enumerate(ranks):
            sizes = (found["held bytes"], found["own bytes"], found["model bytes"])
            # Exactly the unsplit model's tensors by the names this rank's stage reads: no
            # tensor of the other stage, no weight held twice (a tie kept within the stage).
            assert sizes[0] == sizes[1] < sizes[2], (what, rank, sizes)
            # What this rank does not hold stayed on the meta device, unallocated.
            assert every - set(found["names"]) <= set(found["still meta"]), (what, rank)
        mine = [set(found["names"]) for found in ranks]
        assert mine[0] | mine[1] == every, what
        later, earlier = (tuple(f"{b}." for b in case.blocks[2:]),
                          tuple(f"{b}." for b in case.blocks[:2]))
        assert not any(n.startswith(later) for n in mine[0]), what
        assert not any(n.startswith(earlier) for n in mine[1]), what


@in_turn
def test_batches_of_any_length_over_processes(two_ranks: InTurn) -> None:
    """GPT-2, Llama and BERT captured at 12 tokens, trained on 2 processes at 16, 7 and 8
    (ranks without the first stage pass None: the ranks agree on the shapes first) and run at
    20: the loss and every gradient equal the unsplit model's, from the one capture."""
    results = two_ranks("lengths")
    assert all(r["captures"] == [1] * len(LENGTH_RUNS) for r in results)
    assert all(r["checked"] > 0 for r in results)


@in_turn
def test_a_dtype_changed_after_the_split_over_processes(two_ranks: InTurn) -> None:
    """Llama captured in float32, `pipe.to(torch.float64)` on both ranks (each converts only
    its own stage; the rank without the first stage passes None): both ranks capture again
    once, together, at the first step, and two steps (12 and 7 tokens) equal the unsplit
    model in float64, every gradient checked on one rank or the other."""
    results = two_ranks("dtype")
    assert all(r["captures"] == [2, 2] for r in results), results
    params = len(list(length_case("llama").model().parameters()))
    assert sum(r["checked"] for r in results) == 2 * params


@in_turn
def test_each_replica_its_own_length(four_ranks: InTurn) -> None:
    """dp x pp = 2 x 2: one replica's batch of 16 tokens, the other's of 7, in one step: the
    loss and every gradient are the unsplit model's over both batches."""
    checked = four_ranks("lengths dp")
    assert all(c > 0 for c in checked)


@in_turn
def test_checkpoint_loads_into_another_split_and_the_plain_model(
        two_ranks: InTurn, checkpoint_path: Path) -> None:
    """`pipe.save` from GPT-2 split at its third block over 2 processes: `pipe.load` into the
    model split at its second block (2 processes) and `sharded.load` into the plain model
    give the same weights, buffers, AdamW state and learning rate, bit for bit (the tied
    weight's state under the model's name for it); `full_state_dict` gives the
    model's keys and values on rank 0 (checked on the rank, against the unsplit model)."""
    results = two_ranks("checkpoint")
    saved = unpack([r[0] for r in results])
    gathered = unpack([results[0][1]])
    assert results[1][1] is None
    plain = traced_workers.CASES["gpt2"]().model()
    assert sorted(gathered) == sorted(plain.state_dict())
    for key, value in gathered.items():
        assert torch.equal(value, saved[key]), key
    assert any(k.endswith(": exp_avg_sq") for k in saved)

    assert_same(unpack([r[2] for r in results]), saved, "split at another block")

    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.5)
    sharded.load(plain, checkpoint_path, optimizer)
    assert_same(snapshot(plain, optimizer), saved, "plain model")
    assert plain.lm_head.weight is plain.transformer.wte.weight  # still tied


@in_turn
def test_token_micro_batches_over_two_processes(two_ranks: InTurn) -> None:
    """An (ids, mask) nn.Sequential under 1F1B and ZB-H1, and a Llama's own out.loss, cut to
    their tokens over 2 ranks: exact against the unsplit model on the padded batch."""
    results = two_ranks("token micro-batches")
    assert all(r["checked"] > 0 for r in results), results
    assert results[0]["loss"] == results[1]["loss"]  # every rank returns the loss


@in_turn
def test_token_micro_batches_under_dp_x_pp(four_ranks: InTurn) -> None:
    """dp x pp = 2 x 2, `tokens=True`: one replica's 8 rows padded to 12, the other's 6 rows
    padded to 9, each cut to its tokens: an (ids, mask) nn.Sequential under 1F1B and ZB-H1
    (float64) and a Llama's own out.loss equal the unsplit model on both batches as one padded
    batch, loss and every gradient (checked on the ranks); the two pipeline ranks of a replica
    checked every parameter between them, and every rank returns the same loss."""
    results = four_ranks("token micro-batches dp")
    sequential = len(list(tokens_workers.masked_lm().parameters()))
    llama = len(list(tokens_workers.llama().parameters()))
    for replica in (0, 1):  # ranks 2r and 2r + 1: replica r's two stages
        pair = results[2 * replica:2 * replica + 2]
        assert all(r["checked"] > 0 for r in pair), results
        assert sum(r["checked"] for r in pair) == len(TOKEN_DP_SCHEDULES) * sequential + llama
    assert all(r["losses"] == results[0]["losses"] for r in results)
