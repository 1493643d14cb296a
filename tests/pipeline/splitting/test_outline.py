"""Modules kept whole in a model split from its graph (what tensor parallelism needs): which
modules are chosen, that they run as the model's own module objects, that the split model
still trains, infers and replays dropout as the unsplit model, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeline
from pipeline import Pipe, PipeConfigError
from pipeline.parallel.tensor_parallel import matches
from pipeline.splitting.config import check_tensor_parallel
from pipeline.splitting.outline import held_whole, whole_modules
from tests.models_traced import (
    assert_same_training,
    gpt2_case,
    llama_case,
    pipe_steps,
    reference_steps,
    token_count,
)

pytest.importorskip("transformers")

ATTN_MLP = ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.o_proj",
            "model.layers.*.mlp.down_proj"]


def _whole(model: nn.Module, keys: list[str]) -> list[str]:
    return whole_modules(model, [n for key in keys for n in matches(model, key)])


def test_the_parent_block_is_kept_whole_unless_it_holds_the_stack_of_layers() -> None:
    model = llama_case().model()
    chosen = _whole(model, [*ATTN_MLP, "lm_head", "model.embed_tokens"])
    assert chosen == [*(f"model.layers.{i}.self_attn" for i in range(4)),
                      *(f"model.layers.{i}.mlp" for i in range(4)),
                      "lm_head", "model.embed_tokens"]
    # Selecting the attention keeps its decoder layer whole, which covers the q_proj too.
    assert _whole(model, ["model.layers.0.self_attn", "model.layers.0.self_attn.q_proj"]) == [
        "model.layers.0"]
    assert held_whole("model.layers.0.self_attn.q_proj", chosen)
    assert not held_whole("model.layers.0.input_layernorm", chosen)


def test_kept_modules_are_the_models_own_and_train_as_the_unsplit_model() -> None:
    """Llama with its attention and MLP kept whole: they are the model's module objects,
    placed in the stage that runs them, and three AdamW steps under a Pipe equal the unsplit
    model's (losses, gradients, weights), as does inference in eval mode."""
    case = llama_case()
    model = case.model()
    whole = _whole(model, ATTN_MLP)
    split = pipeline.split(model, case.inputs, split_points=["model.layers.2"],
                           keep_whole=whole)
    assert split.whole == tuple(whole)
    for name in whole:
        s = 0 if int(name.split(".")[2]) < 2 else 1
        assert split[s].get_submodule(name) is model.get_submodule(name), name
    want = reference_steps(case, chunks=4)
    pipe = Pipe(split, balance=[1, 1], devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    assert_same_training(pipe_steps(pipe, model, case), want)
    pipe.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(case.inputs).logits, model(**case.inputs).logits,
                                   rtol=1e-5, atol=1e-6)
    pipe.close()


def test_recomputation_replays_dropout_inside_kept_modules() -> None:
    """Llama's attention dropout runs inside the modules kept whole: "always" recomputes
    them and draws the same masks as "never" (the same seed); another seed differs."""
    case = llama_case()
    model = case.model(dropout=0.3)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    split = pipeline.split(model, case.inputs, split_points=["model.layers.2"],
                           keep_whole=_whole(model, ATTN_MLP))
    runs = {}
    for checkpoint, seed in (("never", 7), ("always", 7), ("never", 8)):
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        pipe = Pipe(split, balance=[1, 1], devices=["cpu", "cpu"], chunks=2,
                    checkpoint=checkpoint)
        torch.manual_seed(seed)
        pipe.step(case.inputs, case.labels, case.loss, loss_weight=token_count)
        pipe.close()
        runs[(checkpoint, seed)] = {n: p.grad.clone() for n, p in model.named_parameters()}
    q = "model.layers.0.self_attn.q_proj.weight"
    for n, g in runs[("never", 7)].items():
        assert torch.equal(g, runs[("always", 7)][n]), n
    assert not torch.allclose(runs[("never", 7)][q], runs[("never", 8)][q])


def test_refusals() -> None:
    case = gpt2_case()
    model = case.model()
    with pytest.raises(PipeConfigError, match=r"'transformer\.h\.9' is not one"):
        pipeline.split(model, case.inputs, split_points=["transformer.h.2"],
                       keep_whole=["transformer.h.9"])
    with pytest.raises(PipeConfigError, match="lie inside modules kept whole"):
        pipeline.split(model, case.inputs, split_points=["transformer.h.2.attn"],
                       keep_whole=["transformer.h.2"])
    split = pipeline.split(model, case.inputs, split_points=["transformer.h.2"])
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(PipeConfigError, match="runs as traced ops"):
        check_tensor_parallel({"transformer.h.*.attn.c_attn": ColwiseParallel()}, split, [])
