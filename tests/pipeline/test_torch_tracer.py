"""torch.distributed.pipelining's tracer beside ours, on the same models and split points: the
outcomes docs/any-model.md's table reports, measured here (torch's side on the torch release
it was measured on; ours everywhere)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx

from pipeline import Pipe
from tests.models_traced import Case, bert_case, gpt2_case, llama_case, token_count, unet_case

pytest.importorskip("transformers")

CASES = [gpt2_case(), llama_case(), bert_case(), unet_case()]

# What torch's front end does with each model, split before the middle block, on torch 2.13.
# Llama's outcome moved with transformers: its 5.24 attention exports in a form torch's
# split graph runs.
TORCH_2_13 = {
    "gpt2": "wrong: the tied weight becomes two copies",
    "llama": ("fails: Expected positional argument for parameter unsqueeze_default, but one "
              "was not passed in"),
    "bert": "wrong: the tied weight becomes two copies",
    "unet": "exact",
}
TRANSFORMERS_5_24 = {"llama": "exact"}


def _recorded(name: str) -> str:
    import transformers

    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    newer = (major, minor) >= (5, 24)
    return TRANSFORMERS_5_24.get(name, TORCH_2_13[name]) if newer else TORCH_2_13[name]

# fp32, the same ops in another grouping: rtol 1e-5, atol 1e-6 for zero-in-exact-arithmetic.
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}


def _middle(case: Case) -> str:
    return case.blocks[len(case.blocks) // 2]


def _output(case: Case, flat: Any) -> Any:
    """torch's split graph returns the model's output flattened: rebuilt as the loss reads it."""
    values = list(flat) if isinstance(flat, tuple | list) else [flat]
    if case.name == "unet":
        return {"logits": values[0], "features": values[1]}

    class Output:
        logits = values[0]
    return Output()


def _torch_outcome(case: Case) -> str:
    """Split with torch's `pipeline()`, run its stages in order in this process (its
    `split_gm`, node by node), one backward and one AdamW step, against the unsplit model."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    model, reference = case.model(), case.model()
    try:
        split = pipeline(model, mb_args=(), mb_kwargs=case.inputs,
                         split_spec={_middle(case): SplitPoint.BEGINNING})
        graph = split.split_gm
        names = [n.target for n in graph.graph.nodes if n.op == "placeholder"]
        flat = torch.fx.Interpreter(graph).run(*[case.inputs.get(n) for n in names])
    except Exception as exc:  # the outcome is recorded, whatever torch raised
        return f"fails: {str(exc).splitlines()[0].split('!')[0]}"
    case.loss(_output(case, flat), case.labels).backward()
    case.loss(reference(**case.inputs), case.labels).backward()
    stages = [dict(graph.get_submodule(f"submod_pp_{s}").named_parameters()) for s in (0, 1)]
    held = {id(p) for s in stages for p in s.values()}
    if len(held) > len({id(p) for p in reference.parameters()}):
        return "wrong: the tied weight becomes two copies"
    want = dict(reference.named_parameters())
    for stage in stages:
        for name, p in stage.items():
            if not torch.allclose(p.grad, want[name].grad, **TOL):
                return f"wrong: the gradient of {name}"
    return "exact"


@pytest.mark.skipif(not torch.__version__.startswith("2.13."),
                    reason="torch's outcomes were measured on torch 2.13")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_front_end_outcome_is_the_recorded_one(case: Case) -> None:
    assert _torch_outcome(case) == _recorded(case.name)


def test_torch_splits_the_tied_gpt2_into_copies_that_drift_apart() -> None:
    """What "two copies" means in training: after one AdamW step the head and the embedding,
    one weight in the model, hold different values."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    case = gpt2_case()
    split = pipeline(case.model(), mb_args=(), mb_kwargs=case.inputs,
                     split_spec={_middle(case): SplitPoint.BEGINNING})
    graph = split.split_gm
    names = [n.target for n in graph.graph.nodes if n.op == "placeholder"]
    flat = torch.fx.Interpreter(graph).run(*[case.inputs.get(n) for n in names])
    case.loss(_output(case, flat), case.labels).backward()
    torch.optim.AdamW(graph.parameters(), lr=1e-2).step()
    wte = graph.get_submodule("submod_pp_0").get_parameter("transformer.wte.weight")
    head = graph.get_submodule("submod_pp_1").get_parameter("lm_head.weight")
    assert wte is not head and not torch.equal(wte, head)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ours_is_exact_on_every_model(case: Case) -> None:
    """The same models and split points: loss, every gradient and the weights after one AdamW
    step equal the unsplit model's (the full sweep is in tests/pipeline/splitting/)."""
    model, reference = case.model(), case.model()
    pipe = Pipe(model, example_inputs=case.inputs, split_points=[_middle(case)],
                devices=["cpu", "cpu"], chunks=1)
    loss = pipe.step(case.inputs, case.labels, case.loss, loss_weight=token_count)
    expected = case.loss(reference(**case.inputs), case.labels)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
    pipe.close()
    if case.name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight
