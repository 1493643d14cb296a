"""A split model with a tied head converted after the split, and PEFT's prefix tuning: the
recapture reads the tied weight under either name; split points are the model's names."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline import Pipe
from pipeline.splitting.trace import ExportError
from tests.models_collators import BLOCK, build, padded
from tests.pipeline.reference import grads_equal

pytest.importorskip("transformers")

# Hugging Face computes its loss in float32 (it upcasts the logits): the loss, and the
# gradient it sends back into float64 logits, carry float32 rounding (~1e-7 relative).
HF_TOL = {"rtol": 1e-5, "atol": 1e-8}


def _model_loss(out: object, target: object) -> torch.Tensor:
    return out.loss  # type: ignore[attr-defined,no-any-return]


def _batch() -> dict[str, object]:
    ids, mask = padded([8, 5, 8, 3], 8)
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100), "use_cache": False}


@pytest.mark.parametrize("name", ["opt", "falcon", "gemma2"])
def test_a_tied_head_converted_after_the_split_is_captured_again(name: str) -> None:
    """pipe.to(dtype) refused: "stage 0 would read ['lm_head.weight', 'lm_head.weight'] ...
    convert the model before splitting it": stage 0 holds the tied weight under both of its
    names, but the check looked at one."""
    model = build(name, torch.float32)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
    batch = _batch()
    pipe = Pipe(model, example_inputs=batch, split_points=[BLOCK[name]], chunks=2)
    reference = copy.deepcopy(model).double()
    pipe.to(torch.float64)
    loss = pipe.step(batch, None, _model_loss)
    assert pipe._io is not None and pipe._io.captures == 2
    expected = reference(**batch).loss
    expected.backward()
    assert grads_equal(model, reference, loss, expected, name, HF_TOL) > 0


def test_prefix_tuning_names_real_split_points_and_trains_exactly() -> None:
    """Qwen3 under prefix tuning runs its layers through a slice of the ModuleList, which
    export records as `layers.slice(None, 2, None).0`: the listed valid split points were
    those, and `base_model.model.layers.1` "never runs"."""
    from peft import PrefixTuningConfig, get_peft_model

    def tuned() -> torch.nn.Module:
        return get_peft_model(build("qwen3"), PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                 num_virtual_tokens=3))
    batch = _batch()
    with pytest.raises(ExportError, match=r"e\.g\. 'base_model\.model\.layers\.0', "
                                          r"'base_model\.model\.layers\.1'\)"):
        Pipe(tuned(), example_inputs=batch, split_points=["base_model.model.layers.x"],
             chunks=2)
    model, reference = tuned(), tuned()
    pipe = Pipe(model, example_inputs=batch, split_points=["base_model.model.layers.1"],
                chunks=2)
    loss = pipe.step(batch, None, _model_loss)
    expected = reference(**batch).loss
    expected.backward()
    assert grads_equal(model, reference, loss, expected, "prefix", HF_TOL) > 0


def test_a_cache_coming_back_despite_use_cache_false_is_said_so() -> None:
    """OPT under prefix tuning returns the cache its prefixes came in: the refusal asked for
    use_cache=False, which was passed."""
    from peft import PrefixTuningConfig, get_peft_model

    model = get_peft_model(build("opt"), PrefixTuningConfig(task_type="CAUSAL_LM",
                                                            num_virtual_tokens=3))
    with pytest.raises(ExportError, match="although use_cache=False: a cache passed in") as exc:
        Pipe(model, example_inputs=_batch(), split_points=["base_model.model.decoder.layers.1"],
             chunks=2)
    assert "pass use_cache=False" not in str(exc.value)
