"""Tensor parallelism inside stages over gloo processes: Pipes on (dp, pp, tp) meshes of
1x2x2 and 2x1x2 against one device (an MLP, a transformer under Megatron's plan and its
sequence-parallel variant), dropout replayed under recomputation, checkpoints across
layouts, refusals, and failures named by their coordinates."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.launch import spawn
from pipeline.state import sharded
from tests import models_tp
from tests.limits import IN_TURN_TIMEOUT, SPAWN_TIMEOUT
from tests.pipeline import tp_workers
from tests.pipeline.in_turn import InTurn, in_turn
from tests.pipeline.sharded_workers import unpack

pytestmark = [pytest.mark.dist]

RUNS_1X2X2 = [("mlp", "", "gpipe", "never"), ("mlp", "", "1f1b", "always"),
              ("transformer", "megatron", "1f1b", "never"),
              ("transformer", "megatron", "gpipe", "always"),
              ("transformer", "sp", "1f1b", "except_last"),
              ("transformer", "sp", "gpipe", "always"),
              ("transformer", "megatron", "zb-h1", "never"),
              ("transformer", "megatron", "interleaved", "except_last"),
              ("transformer", "sp", "zb-v", "never")]
RUNS_2X1X2 = [("mlp", "", "1f1b", "never"), ("transformer", "megatron", "gpipe", "always"),
              ("transformer", "sp", "1f1b", "never")]


RUNS_FSDP = [("mlp", "", "gpipe", "always"), ("transformer", "megatron", "1f1b", "never"),
             ("transformer", "sp", "1f1b", "except_last")]


LAYOUTS = {"1x2x2": ((1, 2, 2), RUNS_1X2X2, "replicate"),
           "2x1x2": ((2, 1, 2), RUNS_2X1X2, "replicate"),
           "2x1x2-fsdp": ((2, 1, 2), RUNS_FSDP, "fsdp")}
LLAMA_RUNS = [("1f1b", "never"), ("gpipe", "always"), ("interleaved", "except_last")]

# The scenarios that end without an error, on one set of 4 ranks in turn (see
# tests/pipeline/in_turn.py); each test below checks its own. The fixture adds the planned
# configuration's run, the checkpoint's (in a directory of its own) and the refusals.
FOUR_RANKS = [
    *[(layout, tp_workers.train_like_one_device, args) for layout, args in LAYOUTS.items()],
    # Hugging Face Llama where transformers is installed (its test skips otherwise).
    *([("llama", tp_workers.llama_like_one_device, (LLAMA_RUNS,))]
      if importlib.util.find_spec("transformers") else []),
    ("2bw", tp_workers.two_bw_rule, ()),
    ("dropout", tp_workers.dropout_replay, ()),
]


@functools.cache
def _planned() -> Any:
    """`pipeline.plan` with the transformer's tp plan over 4 gloo ranks (tp 2 within a host
    of 2), once per run: its test checks the choice, the ranks train it."""
    from pipeline import plan
    from pipeline.planner import Link

    x, y = models_tp.batch("transformer", 0)
    return plan(models_tp.transformer(), x, y, models_tp.token_loss, ranks=4,
                memory_per_rank=None, transport="gloo", tp_plan=models_tp.transformer_plan(),
                tp_sizes=[2], ranks_per_host=2, chunks=[2], repeats=1,
                link=Link("gloo", 0.0, 0.0), contention=1.0)


def _planned_kwargs() -> dict[str, Any]:
    return {k: v for k, v in _planned().pipe_kwargs(mesh=None).items() if k != "mesh"}


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp") / "ckpt"


@pytest.fixture(scope="module")
def four_ranks(checkpoint_path: Path) -> InTurn:
    p = _planned()
    return InTurn(4, [*FOUR_RANKS,
                      ("planned", tp_workers.planned, ((p.dp, p.pp, p.tp), _planned_kwargs())),
                      ("checkpoint", tp_workers.save_and_load_elsewhere,
                       (str(checkpoint_path),)),
                      # Last: each refused on every rank, which then goes on.
                      ("refusals", tp_workers.errors, ())],
                  timeout=IN_TURN_TIMEOUT)


@in_turn
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trains_as_one_device(layout: str, four_ranks: InTurn) -> None:
    """Two AdamW steps: losses, every gradient (clipped on the second step, the norm too)
    and the weights after equal one device's, for each run; together the ranks checked
    every parameter of the model."""
    runs = LAYOUTS[layout][1]
    results = four_ranks(layout)
    for i, (name, *_rest) in enumerate(runs):
        model = models_tp.mlp() if name == "mlp" else models_tp.transformer()
        every = {n for n, _ in model.named_parameters()}
        assert set().union(*(r[i] for r in results)) == every, runs[i]


@in_turn
def test_llama_split_by_module_names_with_a_tp_plan(four_ranks: InTurn) -> None:
    """Hugging Face Llama (grouped-query attention, rotary tables and the mask crossing the
    cut) split from its graph at module names, its attention and MLP sharded by Megatron's
    plan (kept whole as modules inside the traced stages): two AdamW steps equal the unsplit
    model's; the ranks together checked every parameter."""
    pytest.importorskip("transformers")
    from tests.models_traced import llama_case

    results = four_ranks("llama")
    every = {n for n, _ in llama_case().model().named_parameters()}
    for i, run in enumerate(LLAMA_RUNS):
        assert set().union(*(r[i] for r in results)) == every, run


@in_turn
def test_a_planned_dp_pp_tp_configuration_runs_and_trains_exactly(four_ranks: InTurn) -> None:
    """`pipeline.plan` with the transformer's tp plan over 4 gloo ranks (tp 2 within a host
    of 2): the chosen (dp, pp, tp)'s Pipe, built from `pipe_kwargs(mesh=...)`, trains as one
    device for two AdamW steps."""
    p = _planned()
    assert p.tp == 2 and p.dp * p.pp * p.tp == 4
    assert _planned_kwargs()["tp_plan"].keys() == models_tp.transformer_plan().keys()
    results = four_ranks("planned")
    every = {n for n, _ in models_tp.transformer().named_parameters()}
    assert set().union(*results) == every


@in_turn
def test_2bw_follows_its_stale_update_rule_under_tp(four_ranks: InTurn) -> None:
    assert four_ranks("2bw") == [2] * 4


@in_turn
def test_dropout_replays_and_tp_ranks_agree(four_ranks: InTurn) -> None:
    losses = four_ranks("dropout")
    # Each pipeline (tp coordinate) computed its loss from its own shards: equal losses
    # mean the tp ranks drew the same masks.
    assert losses[0] == losses[1] == losses[2] == losses[3]


@in_turn
def test_checkpoint_loads_across_layouts_and_into_a_plain_model(
        four_ranks: InTurn, checkpoint_path: Path) -> None:
    """Saved at 1x2x2 (dp x pp x tp), loaded at 1x4x1 and into the plain model: the
    weights after the step, whole, each time; `full_state_dict` gathers them too."""
    path = checkpoint_path
    # The ranks save at 1x2x2 and then load at 1x4x1 (their second mesh).
    saved = four_ranks("checkpoint")
    whole = unpack([state for state, _, _ in saved])
    assert saved[0][1] is not None and all(full is None for _, full, _ in saved[1:])
    full = unpack([saved[0][1]])
    plain = models_tp.transformer(seed=7)
    assert set(whole) == set(plain.state_dict()) == set(full)
    for k, v in whole.items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=0, msg=k)
    sharded.load(plain, path)
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(v, whole[k], rtol=0, atol=0, msg=k)
    got = unpack([loaded for _, _, loaded in saved])
    assert set(got) == set(whole)
    for k, v in got.items():
        torch.testing.assert_close(v, whole[k], rtol=0, atol=0, msg=k)


@in_turn
def test_refusals(four_ranks: InTurn) -> None:
    for messages in four_ranks("refusals"):
        no_plan, typo, tied, disagree = messages
        assert "disagree on their configuration: tp rank(s) [1] differ" in disagree
        assert "'tp' dimension of size 2 but no tp_plan" in no_plan
        assert "'*.atn.q' selects no module" in typo and "did you mean" in typo
        assert "tied across stages" in tied and "'0.weight'" in tied


def test_a_failure_is_named_by_its_coordinates() -> None:
    results = spawn(tp_workers.failure_names_coordinates, 4, timeout=SPAWN_TIMEOUT)
    messages = [first for first, _ in results]
    assert "a loss that fails on one shard" in messages[3]
    for m in messages[:3]:
        assert "tp 1" in m, m
    # Every later call on every rank: a PipelineError, as docs/multi-process.md promises
    # (ranks 0 and 2 raised a raw PipelineAborted from the step's seed agreement).
    for rank, (_, later) in enumerate(results):
        for seen in later:
            assert seen.startswith("PipelineError: "), (rank, seen)
