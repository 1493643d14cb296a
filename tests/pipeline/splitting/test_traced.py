"""Models split from their exported graphs train exactly as unsplit: GPT-2 (tied head), Llama
(grouped-query attention, rotary, untied head), BERT (tied decoder, segments, attention mask) and
a U-Net (skip connections across stages, BatchNorm), under every schedule and recomputation mode;
`pipeline.split` on its own, automatic splits, and the state a Pipe shares with the model."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from torch import nn

import pipeline
from pipeline import Pipe, SplitModel
from tests.models_traced import (
    Case,
    assert_same_training,
    bert_case,
    exports_reused,
    gpt2_case,
    llama_case,
    pipe_steps,
    reference_steps,
    token_count,
    unet_case,
)
from tests.strategies import traced_pipes

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
CHECKPOINTS = ["never", "except_last", "always"]
TWO_PER_RANK = {"interleaved", "zb-v"}  # schedules that hold two stages on every rank
CASES = {"gpt2": gpt2_case, "llama": llama_case, "bert": bert_case, "unet": unet_case}
# Four stages: the U-Net's first encoder's features cross three cuts to the last decoder.
FOUR_STAGES = {"unet": ["enc2", "mid", "dec2"]}


class Split:
    """A case's model split once into four stages, with its initial state: every Pipe of a
    sweep runs on it from that state (exporting is the slow part; a Pipe over the split model
    is cheap), and the unsplit model's training, recorded once per chunking."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.model = case.model()
        self.initial = copy.deepcopy(self.model.state_dict())
        points = FOUR_STAGES.get(case.name, case.blocks[1:])
        self.split = pipeline.split(self.model, case.inputs, split_points=points)
        self._references: dict[int | None, Any] = {}

    def reference(self, chunks: int | None) -> Any:
        if chunks not in self._references:
            self._references[chunks] = reference_steps(self.case, chunks)
        return self._references[chunks]

    @property
    def batchnorm(self) -> bool:
        return any(isinstance(m, nn.BatchNorm2d) for m in self.model.modules())

    def train(self, schedule: str, checkpoint: str, chunks: int,
              balance: list[int] | None = None) -> None:
        """A Pipe over the split model trains as the unsplit model did."""
        self.model.load_state_dict(self.initial)
        self.model.train()
        stages = len(self.split) if balance is None else len(balance)
        per_rank = 2 if schedule in TWO_PER_RANK else 1
        pipe = Pipe(self.split, balance=balance or [1] * stages,
                    devices=["cpu"] * (stages // per_rank), chunks=chunks, schedule=schedule,
                    checkpoint=checkpoint)
        try:
            got = pipe_steps(pipe, self.model, self.case)
        finally:
            pipe.close()
        # Rows are independent in the transformers: the whole batch at once is the reference.
        assert_same_training(got, self.reference(chunks if self.batchnorm else None))


class _Splits(dict[str, Split]):
    """Each case split the first time a test asks for it."""

    def __missing__(self, name: str) -> Split:
        self[name] = Split(CASES[name]())
        return self[name]


@pytest.fixture(scope="module")
def splits() -> dict[str, Split]:
    return _Splits()


@pytest.mark.parametrize(("schedule", "checkpoint"),
                         list(itertools.product(SCHEDULES, CHECKPOINTS)))
def test_gpt2_trains_exactly_under_every_schedule_and_recomputation(
        splits: dict[str, Split], schedule: str, checkpoint: str) -> None:
    splits["gpt2"].train(schedule, checkpoint, chunks=4)


# Every schedule once per model, the recomputation mode turning with it.
_SMALL_SWEEP = [(name, schedule, CHECKPOINTS[i % 3])
                for name in ("llama", "bert", "unet") for i, schedule in enumerate(SCHEDULES)]


@pytest.mark.parametrize(("name", "schedule", "checkpoint"), _SMALL_SWEEP)
def test_models_train_exactly_under_every_schedule(splits: dict[str, Split], name: str,
                                                   schedule: str, checkpoint: str) -> None:
    """For the U-Net each of the 4 micro-batches is normalised by its own statistics: the
    reference runs the unsplit model micro-batch by micro-batch (see reference_steps)."""
    splits[name].train(schedule, checkpoint, chunks=4)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_unet_in_one_micro_batch_equals_the_whole_batch(splits: dict[str, Split],
                                                        checkpoint: str) -> None:
    """With chunks=1 BatchNorm sees the whole batch, as in the unsplit model run on it."""
    unet = splits["unet"]
    unet.train("1f1b", checkpoint, chunks=1)
    # The per-micro-batch reference differs from the whole batch's: the test above compares
    # with what a pipeline of micro-batches must compute, not with something any run gives.
    whole, parts = unet.reference(None), unet.reference(4)
    assert not torch.allclose(whole.losses[0], parts.losses[0], rtol=1e-3)


def test_batchnorm_running_statistics_follow_the_micro_batches(splits: dict[str, Split]) -> None:
    """After a step, each BatchNorm's running statistics are those of the micro-batches'
    forwards in turn, once each: replays under recomputation leave them alone."""
    unet = splits["unet"]
    unet.train("1f1b", "always", chunks=4)  # also compares every buffer after every step
    bn = unet.model.get_submodule("dec1.1")
    assert int(bn.num_batches_tracked) == 4 * 3  # 4 micro-batches x 3 steps
    want = unet.reference(4).states[-1]
    torch.testing.assert_close(bn.running_mean, want["dec1.1.running_mean"], rtol=1e-5,
                               atol=1e-6)
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))


@settings(max_examples=6, deadline=None)
@given(run=traced_pipes(gpt2_case().blocks))
def test_gpt2_split_anywhere_trains_exactly(run: dict[str, Any]) -> None:
    """Any schedule, recomputation mode, chunk count and split points among GPT-2's blocks:
    `Pipe(model, example_inputs=..., split_points=...)` trains as the unsplit model."""
    case = gpt2_case()
    model = case.model()
    # Every example splits the same graph at other points: it is exported once.
    with exports_reused():
        pipe = Pipe(model, example_inputs=case.inputs, split_points=run["split_points"],
                    devices=run["devices"], chunks=run["chunks"], schedule=run["schedule"],
                    checkpoint=run["checkpoint"])
    try:
        assert pipe.balance == [1] * (len(run["split_points"]) + 1)
        got = pipe_steps(pipe, model, case)
    finally:
        pipe.close()
    assert_same_training(got, _gpt2_reference())


_GPT2_REFERENCE: list[Any] = []


def _gpt2_reference() -> Any:
    if not _GPT2_REFERENCE:
        _GPT2_REFERENCE.append(reference_steps(gpt2_case()))
    return _GPT2_REFERENCE[0]


@pytest.mark.parametrize(("name", "points", "schedule"), [
    ("gpt2", ["transformer.h.2"], "1f1b"),
    ("llama", ["model.layers.1", "model.layers.2", "model.layers.3"], "interleaved"),
    ("bert", ["bert.encoder.layer.2"], "zb-h1"),
    ("unet", ["enc2", "dec2"], "gpipe"),  # enc1's features cross both cuts
])
def test_pipe_over_the_model_itself(name: str, points: list[str], schedule: str) -> None:
    """`Pipe(model, example_inputs=..., split_points=...)`: its state_dict keys and parameters
    are the model's, an optimizer on `model.parameters()` trains it, exactly."""
    case = CASES[name]()
    model = case.model()
    keys = list(model.state_dict())
    stages = len(points) + 1
    pipe = Pipe(model, example_inputs=case.inputs, split_points=points,
                devices=["cpu"] * (stages // (2 if schedule in TWO_PER_RANK else 1)),
                chunks=1 if name == "unet" else 4, schedule=schedule, checkpoint="except_last")
    try:
        assert sorted(pipe.state_dict()) == sorted(keys)
        assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
        got = pipe_steps(pipe, model, case)
    finally:
        pipe.close()
    assert_same_training(got, reference_steps(case))


def test_split_holds_the_models_own_tensors_under_its_keys(splits: dict[str, Split]) -> None:
    """`pipeline.split`: an nn.Sequential of stages holding the model's own Parameter and
    buffer objects, whose state_dict speaks the model's keys and loads the model's."""
    gpt2 = splits["gpt2"]
    model, split = gpt2.model, gpt2.split
    assert isinstance(split, SplitModel) and isinstance(split, nn.Sequential)
    assert len(split) == 4
    own = {id(t) for t in [*model.parameters(), *model.buffers()]}
    held = {id(t) for stage in split
            for name, t in [*stage.named_parameters(), *stage.named_buffers()]
            if not name.startswith(("_train_", "_eval_"))}  # constants of the graphs
    assert held == own
    assert split[0].get_parameter("transformer.wte.weight") is model.transformer.wte.weight
    assert split[3].get_parameter("transformer.ln_f.weight") is model.transformer.ln_f.weight
    # Each key once, in stage order (the tied head's key comes with the first stage).
    assert sorted(split.state_dict()) == sorted(model.state_dict())
    # The keys say where each tensor is, in the model: the values are the model's.
    for key, value in split.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    other = gpt2.case.model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    split.load_state_dict(other.state_dict())
    torch.testing.assert_close(model.transformer.h[3].mlp.c_fc.weight,
                               other.transformer.h[3].mlp.c_fc.weight, rtol=0, atol=0)
    model.load_state_dict(gpt2.initial)


def test_split_is_called_as_the_model(splits: dict[str, Split]) -> None:
    """Calling the split model as the model is called gives the model's output, of its type."""
    for name in ("gpt2", "unet"):
        s = splits[name]
        s.model.load_state_dict(s.initial)
        s.model.eval()
        s.split.eval()
        want = s.model(**s.case.inputs)
        got = s.split(**s.case.inputs)
        s.model.train()
        s.split.train()
        assert type(got) is type(want)
        key = "logits"
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_pieces_grouped_by_a_balance_train_exactly(splits: dict[str, Split]) -> None:
    """`Pipe(pipeline.split(model, ex, split_points=<every block>), balance=[k, ...])` runs
    several pieces per stage, its stages chaining their values."""
    splits["gpt2"].train("1f1b", "except_last", chunks=4, balance=[3, 1])
    splits["llama"].train("zb-h1", "always", chunks=2, balance=[1, 2, 1])


@pytest.mark.parametrize("balance", ["params", "time"])
def test_stages_chosen_automatically_train_exactly(balance: str) -> None:
    """`Pipe(model, example_inputs=..., stages=N, balance=...)` splits at the model's blocks."""
    case = llama_case()
    model = case.model()
    pipe = Pipe(model, example_inputs=case.inputs, stages=2, balance=balance,
                devices=["cpu", "cpu"], chunks=4, schedule="1f1b")
    try:
        assert pipe.balance == [1, 1]
        held = [{key.split(".")[3] for key in part.state_dict() if ".layers." in key}
                for part in pipe.partitions]  # "0.model.layers.<i>.<...>"
        first = len(held[0])
        assert 1 <= first <= 3  # each stage holds a layer
        assert held == [{str(i) for i in range(first)}, {str(i) for i in range(first, 4)}]
        if balance == "params":  # the four layers hold equal parameters; embedding and head too
            assert first == 2
        got = pipe_steps(pipe, model, case)
    finally:
        pipe.close()
    assert_same_training(got, reference_steps(case))


def test_split_into_n_stages_standalone() -> None:
    """`pipeline.split(model, ex, stages=N)` gives N stages whatever N the blocks allow."""
    case = llama_case()
    model = case.model()
    split = pipeline.split(model, case.inputs, stages=4, balance="uniform")
    assert len(split) == 4
    assert split.split_points == case.blocks[1:]


def test_tied_head_gradient_reaches_the_embedding(splits: dict[str, Split]) -> None:
    """Regression: GPT-2's exported graph reads the tied weight as `lm_head.weight` in the
    embedding's stage too, so the Pipe's tree showed the owner under the head's key, and the
    head's copy was looked up there: its gradient was never added to the embedding's (off by
    0.11) and stayed on the copy."""
    gpt2 = splits["gpt2"]
    model, split, case = gpt2.model, gpt2.split, gpt2.case
    model.load_state_dict(gpt2.initial)
    model.zero_grad(set_to_none=True)
    pipe = Pipe(split, balance=[1, 1, 1, 1], devices=["cpu"] * 4, chunks=2)
    try:
        pipe.step(case.inputs, case.labels, case.loss, loss_weight=token_count)
        assert split[3].get_submodule("lm_head").weight.grad is None  # added, then cleared
    finally:
        pipe.close()
    torch.testing.assert_close(model.transformer.wte.weight.grad,
                               gpt2.reference(None).grads[0]["transformer.wte.weight"],
                               rtol=1e-5, atol=1e-6)


def test_pipe_state_is_the_models_and_the_tied_head_is_tied_again(
        splits: dict[str, Split]) -> None:
    """The Pipe's state_dict has the model's keys and values; an optimizer on the model's
    parameters steps the Pipe's weights; the head, a copy on its stage while the Pipe runs, is
    the embedding again once the Pipe closes."""
    gpt2 = splits["gpt2"]
    model, split, case = gpt2.model, gpt2.split, gpt2.case
    model.load_state_dict(gpt2.initial)
    pipe = Pipe(split, balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    head = split[3].get_submodule("lm_head")
    wte = model.transformer.wte.weight
    try:
        assert sorted(pipe.state_dict()) == sorted(model.state_dict())
        assert head.weight is not wte  # the last stage runs on its copy
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        before = wte.detach().clone()
        pipe.step(case.inputs, case.labels, case.loss, loss_weight=token_count)
        optimizer.step()
        assert not torch.equal(wte, before)
        # The Pipe's own view of the weights moved with the model's.
        assert torch.equal(pipe.state_dict()["transformer.wte.weight"], wte)
        assert torch.equal(pipe.state_dict()["lm_head.weight"], wte)
        pipe.step(case.inputs, case.labels, case.loss, loss_weight=token_count)
        torch.testing.assert_close(head.weight, wte, rtol=0, atol=0)  # refreshed before use
    finally:
        pipe.close()
    assert head.weight is wte
    assert model.lm_head.weight is model.transformer.wte.weight
    model.load_state_dict(gpt2.initial)
