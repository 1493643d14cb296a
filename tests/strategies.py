"""Hypothesis strategies shared by the test suite."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

import schedules

__all__ = ["schedule_args", "schedules_any"]

ranks = st.integers(1, 8)
microbatches = st.integers(1, 32)


@st.composite
def schedule_args(draw: st.DrawFn, name: str | None = None) -> tuple[str, int, int, dict[str, int]]:
    """(name, num_ranks, num_microbatches, options) for any registered generator."""
    name = name or draw(st.sampled_from(schedules.available()))
    options: dict[str, int] = {}
    if name == "interleaved":
        options["stages_per_rank"] = draw(st.integers(2, 4))
    if name == "2bw":
        options["num_batches"] = draw(st.integers(1, 3))
    return name, draw(ranks), draw(microbatches), options


def schedules_any(name: str | None = None) -> st.SearchStrategy[Any]:
    """A generated schedule of any registered generator (or of `name`)."""
    return schedule_args(name).map(lambda a: schedules.get_schedule(a[0], a[1], a[2], **a[3]))
