"""DOT: every dependency is an edge, and the critical path is as long as the makespan."""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedules
from schedules import Costs, Schedule
from schedules.graph import prerequisites
from tests.strategies import schedules_any
from viz import render_dot
from viz.render_dot import critical_path, dependency_graph, dot_to_image

DATA = Path(__file__).parent / "data"
EDGE = re.compile(r"^  r(\d+)s(\d+) -> r(\d+)s(\d+)(.*);$", re.M)
small = schedules_any().filter(lambda s: sum(map(len, s.actions)) <= 300)


def _edges(dot: str) -> dict[tuple[tuple[int, int], tuple[int, int]], str]:
    return {((int(a), int(b)), (int(c), int(d))): attrs for a, b, c, d, attrs in EDGE.findall(dot)}


@given(small)
def test_every_prerequisite_and_every_rank_order_is_an_edge(schedule: Schedule) -> None:
    dot = render_dot(schedule)
    edges = _edges(dot)
    where = {(a.stage, a.op, a.microbatch): (r, i)
             for r, row in enumerate(schedule.actions) for i, a in enumerate(row)}
    deps = prerequisites(schedule)
    want_data = {(where[k], (r, i)) for r, row in enumerate(schedule.actions)
                 for i, a in enumerate(row) for k in deps(a)}
    want_order = {((r, i), (r, i + 1)) for r, row in enumerate(schedule.actions)
                  for i in range(len(row) - 1)}
    assert set(edges) == want_data | want_order
    for edge in want_order - want_data:
        assert "style=dashed" in edges[edge]
    for edge in want_data:
        assert "dashed" not in edges[edge]
    assert len(re.findall(r"^    r\d+s\d+ \[", dot, re.M)) == sum(map(len, schedule.actions))


@given(small, st.sampled_from([Costs(), Costs(forward=1.5, backward=2, comm=0.25),
                               Costs(backward_input=2, backward_weight=0.5, comm=1)]),
       st.booleans())
def test_critical_path_is_the_makespan(schedule: Schedule, costs: Costs, lowered: bool) -> None:
    if lowered:
        schedule = schedules.lower(schedule)
    found = critical_path(dependency_graph(schedule), costs)
    assert found is not None
    path, length = found
    assert length == pytest.approx(schedules.simulate(schedule, costs).makespan)
    # A path: each node is a predecessor (same rank next step, or a data edge) of the next.
    graph = dependency_graph(schedule)
    edges = set(graph.order) | set(graph.data)
    assert all((u, v) in edges for u, v in itertools.pairwise(path))


def test_critical_path_is_red() -> None:
    schedule = schedules.get_schedule("1f1b", 2, 3)
    dot = render_dot(schedule)
    found = critical_path(dependency_graph(schedule))
    assert found is not None
    path, length = found
    assert length == 12 and "critical path (red): length 12" in dot
    red_nodes = {(int(r), int(i)) for r, i in
                 re.findall(r"^    r(\d+)s(\d+) \[.*penwidth=2\.5", dot, re.M)}
    assert red_nodes == set(path)
    red_edges = {e for e, attrs in _edges(dot).items() if "penwidth=2.5" in attrs}
    assert red_edges == set(itertools.pairwise(path))


def test_invalid_schedule_marks_its_failing_steps() -> None:
    dot = render_dot(schedules.load_csv(DATA / "deadlock.csv"))
    assert "INVALID: deadlock" in dot
    assert "no critical path: the graph has a cycle" in dot
    assert len(re.findall(r"penwidth=4", dot)) == 2
    s = schedules.get_schedule("1f1b", 2, 2)
    missing = render_dot(s.replace(actions=(s.actions[0], s.actions[1][:-1])))
    assert 'label="missing 1B1"' in missing


def test_huge_graphs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"has 1024 actions, more than 400"):
        render_dot(schedules.get_schedule("1f1b", 8, 64))
    assert render_dot(schedules.get_schedule("1f1b", 8, 64), max_nodes=1024)


def test_labels_are_quoted() -> None:
    dot = render_dot(schedules.get_schedule("gpipe", 1, 1).replace(name='say "hi" \\ bye'))
    assert 'label="say \\"hi\\" \\\\ bye:' in dot


def test_rendering_needs_the_dot_program(monkeypatch: pytest.MonkeyPatch) -> None:
    source = render_dot(schedules.get_schedule("gpipe", 2, 1))
    if shutil.which("dot") is not None:
        image = dot_to_image(source, "svg")
        assert image is not None and b"<svg" in image
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert dot_to_image(source, "svg") is None
