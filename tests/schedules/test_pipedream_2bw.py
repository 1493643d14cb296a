import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import schedules
from schedules import Action, Op
from tests.schedules.tables import rows
from tests.strategies import schedule_args


def test_p2_m2_two_batches() -> None:
    assert rows("2bw", 2, 2, num_batches=2) == [
        "0F0v0 0F1v0 0B0v0 0F2v1 0B1v0 0U0 0F3v1 0B2v1 0B3v1 0U1",
        "1F0v0 1B0v0 1F1v0 1B1v0 1U0 1F2v1 1B2v1 1F3v1 1B3v1 1U1",
    ]


def test_no_flush_between_batches() -> None:
    # Rank 0 starts batch 1 (micro-batch 2) before batch 0's backwards are done.
    row = schedules.get_schedule("2bw", 2, 2, num_batches=2).actions[0]
    assert row.index(Action(0, Op.F, 2, 1)) < row.index(Action(0, Op.B, 1, 0))


@given(schedule_args("2bw"))
def test_valid_and_two_versions(args: tuple[str, int, int, dict[str, int]]) -> None:
    _, p, m, options = args
    s = schedules.validate(schedules.get_schedule("2bw", p, m, **options))
    n = options["num_batches"]
    assert s.num_batches == n
    for rank, row in enumerate(s.actions):
        updates = [a.microbatch for a in row if a.op is Op.U]
        assert updates == list(range(n))
        # Versions in use on a rank at any point: at most two (the validator's rule, recounted).
        live: set[int] = set()
        open_mbs: dict[int, int] = {}
        for a in row:
            if a.op is Op.F:
                assert a.version is not None
                open_mbs[a.microbatch] = a.version
            elif a.op is Op.B:
                assert open_mbs.pop(a.microbatch) == a.version
            live = set(open_mbs.values())
            assert len(live) <= 2, (rank, a)
    peak = schedules.simulate(s).peak_activations
    assert all(pk <= p - r for r, pk in enumerate(peak))


def test_wrong_version_is_rejected() -> None:
    s = schedules.get_schedule("2bw", 2, 2, num_batches=2)
    rows_ = [list(r) for r in s.actions]
    i = rows_[0].index(Action(0, Op.F, 2, 1))
    rows_[0][i] = Action(0, Op.F, 2, 0)
    with pytest.raises(schedules.ScheduleError, match="weight version 1"):
        schedules.validate(s.replace(actions=tuple(map(tuple, rows_))))


def test_batch_two_before_its_version_exists_is_rejected() -> None:
    # Batch 2 computes with version 2, made by update U0: running it before U0 is an error.
    s = schedules.get_schedule("2bw", 1, 1, num_batches=3)
    assert [str(a) for a in s.actions[0]] == ["0F0v0", "0B0v0", "0U0", "0F1v1", "0B1v1", "0U1",
                                              "0F2v2", "0B2v2", "0U2"]
    bad = ("0F0v0", "0B0v0", "0F1v1", "0F2v2", "0B1v1", "0U0", "0U1", "0B2v2", "0U2")
    with pytest.raises(schedules.ScheduleError, match="not live"):
        schedules.validate(s.replace(actions=(tuple(Action.parse(c) for c in bad),)))


@given(st.integers(1, 8), st.integers(1, 32), st.integers(1, 4))
@example(4, 2, 2)  # peaks 3, 3, 2, 1 (the README's row once said min(m, p - r) = 2, 2, 2, 1)
def test_peak_activations_closed_form(p: int, m: int, n: int) -> None:
    """Rank r keeps min(p - r, m) micro-batches alive within one batch, and one more,
    min(p - r, m + 1), when batches follow without a flush: its warm-up holds at most m
    forwards, and in the steady state the next batch's forward comes before this batch's
    backward (p=4 m=2 over two batches: 3, 3, 2, 1, not min(m, p - r) = 2, 2, 2, 1)."""
    s = schedules.get_schedule("2bw", p, m, num_batches=n)
    expected = tuple(min(p - r, m + (1 if n > 1 else 0)) for r in range(p))
    assert schedules.simulate(s).peak_activations == expected
