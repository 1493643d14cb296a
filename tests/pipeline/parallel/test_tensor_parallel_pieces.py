"""Tensor parallelism's pieces in one process: the plan's checks and key matching, the mesh's
accepted dimensions, and the helpers that leave plain tensors alone (the runs over
processes are in tests/pipeline/test_tensor_parallel.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipeline import Pipe, PipeConfigError
from pipeline.errors import PipeTypeError
from pipeline.parallel import tensor_parallel
from pipeline.parallel.mesh import Mesh
from tests import models_tp


def _mesh(tp: int | None) -> Mesh:
    """Where a process of a (1, 1, tp) mesh sits (no groups: the checks read sizes only)."""
    return Mesh(pp=None, dp=None, dp_mesh=None, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1,
                ranks=(0,), tp=object() if tp else None, tp_size=tp or 1)


def test_a_plan_needs_a_tp_dimension_and_a_tp_dimension_a_plan() -> None:
    with pytest.raises(PipeConfigError, match="no mesh with one was given"):
        tensor_parallel.check_plan({"0": ColwiseParallel()}, None)
    with pytest.raises(PipeConfigError, match="no mesh with one was given"):
        tensor_parallel.check_plan({"0": ColwiseParallel()}, _mesh(None))
    with pytest.raises(PipeConfigError, match="'tp' dimension of size 2 but no tp_plan"):
        tensor_parallel.check_plan(None, _mesh(2))
    assert tensor_parallel.check_plan(None, _mesh(None)) is None
    plan = {"0": ColwiseParallel()}
    assert tensor_parallel.check_plan(plan, _mesh(2)) == plan


def test_threads_refuse_a_plan() -> None:
    with pytest.raises(PipeConfigError, match="no mesh with one was given"):
        Pipe(models_tp.mlp(), [3, 3], devices=["cpu", "cpu"], tp_plan=models_tp.mlp_plan())


@pytest.mark.parametrize(("plan", "match"), [
    ([("0", ColwiseParallel())], "must be a dict"),
    ({"0": "colwise"}, r"tp_plan\['0'\] must be a torch.distributed.tensor.parallel"),
    ({"": ColwiseParallel()}, "keys are module names"),
    ({3: ColwiseParallel()}, "keys are module names"),
])
def test_a_malformed_plan_is_refused(plan: Any, match: str) -> None:
    with pytest.raises(PipeTypeError, match=match):
        tensor_parallel.check_plan(plan, _mesh(2))


def test_keys_match_as_parallelize_module_reads_them() -> None:
    model = models_tp.transformer()
    assert tensor_parallel.matches(model, "*.attn.q") == [f"{i}.attn.q" for i in range(1, 5)]
    assert tensor_parallel.matches(model, "2.mlp.*") == ["2.mlp.fc", "2.mlp.proj",
                                                         "2.mlp.inner"]
    assert tensor_parallel.matches(model, "[13].ln?") == ["1.ln1", "1.ln2", "3.ln1", "3.ln2"]
    assert tensor_parallel.matches(model, "6") == ["6"]
    assert tensor_parallel.matches(model, "*.atn.q") == []
    assert tensor_parallel.matches(model, "7") == []


def test_a_key_that_selects_nothing_names_the_nearest_modules() -> None:
    model = models_tp.transformer()
    plan = models_tp.transformer_plan()
    with pytest.raises(PipeConfigError, match=r"'1.attn.qq' selects no module.*'1.attn.q'"):
        tensor_parallel.apply_plan(model, {**plan, "1.attn.qq": RowwiseParallel()}, _mesh(2),
                                   model)


@pytest.mark.parametrize("names", [("dp", "pp", "xx"), ("tp",), ("dp", "tp")])
def test_mesh_dimensions_outside_the_shapes_are_refused(names: tuple[str, ...]) -> None:
    class Named:
        mesh_dim_names = names

        def get_group(self, name: str) -> None:
            raise AssertionError("read before the names were checked")

    with pytest.raises(PipeConfigError, match="must be named as one of"):
        Pipe(models_tp.mlp(), [6], mesh=Named())


def test_plain_tensors_pass_through() -> None:
    t = torch.randn(3, requires_grad=True)
    assert tensor_parallel.settle(t) is t
    assert tensor_parallel.settle((t, 1)) == (t, 1)
    assert tensor_parallel.local_tensor(t) is t
    assert tensor_parallel.full_tensor(t) is t
    assert tensor_parallel.like_param(t, t) is t
    other = torch.zeros(3)
    assert tensor_parallel.shard_like(t, other) is other
    p = nn.Parameter(torch.randn(3))
    p.grad = torch.ones(3)
    tensor_parallel.grads_as_params([p])
    assert torch.equal(p.grad, torch.ones(3))


def test_coordinates_name_tp_only_with_a_tp_dimension() -> None:
    assert _mesh(2).coordinates == "dp 0, pp 0, tp 0"
    assert _mesh(None).coordinates == "dp 0, pp 0"
