import pytest
import torch

from pipeline.runtime.microbatch import MicroBatchError, gather, leading_rows, scatter


def test_uneven_split_larger_first() -> None:
    parts = scatter(torch.arange(10), 4)
    assert [p[0].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_tuple_with_non_tensors_passes_them_through() -> None:
    x, mask = torch.randn(6, 3), torch.ones(6, dtype=torch.bool)
    parts = scatter((x, mask, "tag", 3), 3)
    assert [p[2:] for p in parts] == [("tag", 3)] * 3
    assert torch.equal(gather(parts)[0], x)
    assert torch.equal(gather(parts)[1], mask)


def test_errors() -> None:
    with pytest.raises(MicroBatchError, match="cannot split a batch of 3 rows into 4"):
        scatter(torch.randn(3, 2), 4)
    with pytest.raises(MicroBatchError, match="disagree on the batch size"):
        scatter((torch.randn(3, 2), torch.randn(4, 2)), 2)
    with pytest.raises(MicroBatchError, match="no tensor with a batch dimension"):
        scatter(("a", 1), 1)


def test_a_tensor_of_one_row_beside_the_batch_goes_whole_to_every_micro_batch() -> None:
    """`position_ids` of shape (1, T) beside (8, T) inputs: broadcast over the batch by the
    model, so each micro-batch takes all of it (a batch of one row is still split)."""
    x, positions = torch.randn(8, 3), torch.arange(3)[None]
    parts = scatter((x, positions), 4)
    assert [p[0].shape[0] for p in parts] == [2, 2, 2, 2]
    assert all(p[1] is positions for p in parts)
    assert leading_rows((positions, x)) == 8
    assert [p[0].shape for p in scatter(torch.randn(1, 3), 1)] == [(1, 3)]
