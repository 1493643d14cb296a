"""Bad input to Pipe gets a clear error (the rule, the value seen, the fix) before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pipeline import Pipe, PipeConfigError
from pipeline.errors import PipeTypeError


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


X, Y = torch.randn(6, 4), torch.randn(6, 2)


@pytest.mark.parametrize(("kwargs", "kind", "pattern"), [
    ({"devices": ["gpu0", "cpu"]}, ValueError, r"devices\[0\] is 'gpu0'.*'cpu', 'cuda:0'"),
    ({"timeout": -1}, ValueError, r"timeout must be a number of seconds > 0 \(got -1\)"),
    ({"timeout": "5"}, TypeError, r"timeout must be a number of seconds > 0 \(got '5', a str\)"),
    ({"timeout": float("nan")}, ValueError, r"timeout must be .* \(got nan\)"),
    ({"balance": [2, "1"]}, TypeError, r"balance\[1\] is '1' \(a str\).*int"),
    ({"balance": [2, True]}, TypeError, r"balance\[1\] is True \(a bool\)"),
])
def test_bad_construction_arguments(kwargs: dict[str, object], kind: type[Exception],
                                    pattern: str) -> None:
    args = {"balance": [2, 1], **kwargs}
    with pytest.raises(kind, match=pattern) as err:
        Pipe(_model(), **args)  # type: ignore[arg-type]
    assert isinstance(err.value, PipeConfigError)


@pytest.mark.parametrize("call", ["step", "step_many"])
def test_a_missing_loss_function_is_refused_up_front(call: str) -> None:
    pipe = Pipe(_model(), [2, 1], chunks=2)
    with pytest.raises(TypeError, match=r"loss_fn must be callable .* \(got None\).*nn.MSELoss"):
        if call == "step":
            pipe.step(X, Y, None)  # type: ignore[arg-type]
        else:
            pipe.step_many([(X, Y)], None, torch.optim.SGD(pipe.parameters(), lr=0.1))  # type: ignore[arg-type]
    assert all(p.grad is None for p in pipe.parameters())


def test_an_empty_batch_says_so() -> None:
    pipe = Pipe(_model(), [2, 1], chunks=2)
    with pytest.raises(ValueError, match=r"the input has 0 rows.*at least chunks=2 rows"):
        pipe.step(X[:0], Y[:0], nn.MSELoss())


@pytest.mark.parametrize("rows", [1, 3])
def test_a_target_whose_rows_differ_from_the_inputs_is_refused(rows: int) -> None:
    # chunks=1 with one target row broadcast silently before: a wrong loss, no error.
    pipe = Pipe(_model(), [2, 1], chunks=1)
    with pytest.raises(ValueError, match=rf"target has {rows} rows but the input has 6"):
        pipe.step(X, Y[:rows], nn.MSELoss())


@pytest.mark.parametrize("which", ["x", "target"])
@pytest.mark.parametrize(("value", "shown"), [
    ([[0.0] * 4] * 6, "a list"),
    (np.zeros((6, 4), dtype=np.float32), "a numpy.ndarray"),
    ((np.zeros((6, 4)), 1), r"a tuple \(numpy.ndarray, int\) holding no tensor"),
    (torch.tensor(1.0), "a 0-dim tensor"),
])
def test_a_batch_that_is_not_a_tensor_names_its_type(which: str, value: object,
                                                     shown: str) -> None:
    """A list or numpy array once got "the input holds no tensor with a batch dimension to
    split", which named neither the argument nor what was passed."""
    pipe = Pipe(_model(), [2, 1], chunks=2)
    x, y = (value, Y) if which == "x" else (X, value)
    with pytest.raises(PipeTypeError, match=rf"{which} is {shown}.*torch.as_tensor"):
        pipe.step(x, y, nn.MSELoss())
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_step_many_without_an_optimizer_names_it(schedule: str) -> None:
    """Under 2bw it once raised AttributeError: 'NoneType' object has no attribute 'zero_grad'."""
    pipe = Pipe(_model(), [2, 1], chunks=2, schedule=schedule)
    with pytest.raises(PipeTypeError, match=r"optimizer must be a torch.optim.Optimizer.*"
                                            r"\(got None\).*torch.optim.SGD"):
        pipe.step_many([(X, Y)], nn.MSELoss(), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
@pytest.mark.parametrize(("batches", "pattern"), [
    ([X, X], r"batches\[0\] is a 2-dim tensor, not an \(x, target\) pair"),
    ((X, Y), r"batches\[0\] is a 2-dim tensor, not an \(x, target\) pair"),
    ([(X, Y), (X, Y, Y)], r"batches\[1\] is a tuple of 3 items, not an \(x, target\) pair"),
    ([(X, Y), X[0]], r"batches\[1\] is a 1-dim tensor"),
    (5, r"batches must be an iterable of \(x, target\) pairs \(got 5, an int\)"),
])
def test_step_many_batches_must_be_pairs(schedule: str, batches: object, pattern: str) -> None:
    """A list of tensors once unpacked each tensor's two rows as (x, target), or raised a bare
    unpacking error."""
    pipe = Pipe(_model(), [2, 1], chunks=2, schedule=schedule)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(PipeTypeError, match=pattern + r".*\[\(x0, y0\), \(x1, y1\)\]"):
        pipe.step_many(batches, nn.MSELoss(), optimizer)  # type: ignore[arg-type]
    assert all(p.grad is None for p in pipe.parameters())


def test_load_state_dict_names_missing_extra_and_wrong_shape_keys() -> None:
    pipe = Pipe(_model(seed=1), [2, 1])
    good = _model().state_dict()
    missing = {k: v for k, v in good.items() if k != "2.bias"}
    with pytest.raises(ValueError, match=r"missing keys \['2.bias'\]"):
        pipe.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected keys \['9.weight'\]"):
        pipe.load_state_dict({**good, "9.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'0.weight': checkpoint \(1, 4\), model \(4, 4\)"):
        pipe.load_state_dict({**good, "0.weight": torch.zeros(1, 4)})
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.load_state_dict(missing, strict=False)  # as torch: strict=False skips missing keys
    torch.testing.assert_close(pipe.state_dict()["0.weight"], good["0.weight"], rtol=0, atol=0)
    assert not torch.equal(before["0.weight"], good["0.weight"])
