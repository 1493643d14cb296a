"""The dependency graph of a small schedule as graphviz DOT, with its critical path in red."""

from __future__ import annotations

import itertools
import shutil
from collections import deque
from dataclasses import dataclass

from schedules import Costs, Schedule
from schedules.graph import prerequisites
from viz.layout import KIND_NAMES, format_number, kind_of, layout
from viz.scene import COLORS, MARK_COLOR

__all__ = ["MAX_NODES", "Graph", "critical_path", "dependency_graph", "dot_to_image",
           "render_dot"]

MAX_NODES = 400  # beyond this graphviz takes minutes and the picture is a grey smudge

Node = tuple[int, int]  # (rank, step)


@dataclass(frozen=True)
class Graph:
    """Actions as nodes; `order` edges run down a rank's list, `data` edges carry tensors."""

    schedule: Schedule
    order: tuple[tuple[Node, Node], ...]
    data: tuple[tuple[Node, Node], ...]
    missing: tuple[tuple[str, Node], ...]  # prerequisites absent from the schedule -> waiter

    def nodes(self) -> list[Node]:
        return [(r, i) for r, row in enumerate(self.schedule.actions) for i in range(len(row))]


def dependency_graph(schedule: Schedule) -> Graph:
    """Each rank's order, plus an edge from every prerequisite (`schedules.graph`) to its user."""
    deps = prerequisites(schedule)
    where: dict[tuple[int, object, int], Node] = {}
    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            where.setdefault((a.stage, a.op, a.microbatch), (r, i))
    order = tuple(((r, i), (r, i + 1)) for r, row in enumerate(schedule.actions)
                  for i in range(len(row) - 1))
    data, missing = [], []
    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            for key in deps(a):
                source = where.get(key)
                if source is None:
                    stage, op, mb = key
                    missing.append((f"{stage}{op.value}{mb}", (r, i)))
                elif source != (r, i):
                    data.append((source, (r, i)))
    return Graph(schedule, order, tuple(data), tuple(missing))


def critical_path(graph: Graph, costs: Costs | None = None) -> tuple[list[Node], float] | None:
    """The longest path under `costs` and its length (the makespan); None if there is a cycle.

    Node weight: the action's duration; a data edge between ranks adds the comm latency, as the
    simulator does. Every action starts when its last prerequisite ends, so the longest path is
    exactly what bounds the step: speed up anything else and the makespan stays put.
    """
    costs = costs or Costs()
    actions = graph.schedule.actions
    preds: dict[Node, list[tuple[Node, float]]] = {n: [] for n in graph.nodes()}
    for u, v in graph.order:
        preds[v].append((u, 0.0))
    for u, v in graph.data:
        preds[v].append((u, costs.comm if u[0] != v[0] else 0.0))
    succs: dict[Node, list[Node]] = {n: [] for n in preds}
    indegree = {n: len(p) for n, p in preds.items()}
    for v, ps in preds.items():
        for u, _ in ps:
            succs[u].append(v)
    queue = deque(n for n, d in indegree.items() if d == 0)
    finish: dict[Node, float] = {}
    via: dict[Node, Node | None] = {}
    while queue:
        v = queue.popleft()
        start, best = 0.0, None
        for u, weight in preds[v]:
            ready = finish[u] + weight
            if best is None or ready > start:
                start, best = ready, u
        a = actions[v[0]][v[1]]
        finish[v], via[v] = start + costs.of_action(a), best
        for w in succs[v]:
            indegree[w] -= 1
            if indegree[w] == 0:
                queue.append(w)
    if len(finish) < len(preds):
        return None  # a cycle: the schedule deadlocks
    if not finish:
        return [], 0.0
    end = max(finish, key=lambda n: finish[n])
    path: list[Node] = []
    node: Node | None = end
    while node is not None:
        path.append(node)
        node = via[node]
    return path[::-1], finish[end]


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(schedule: Schedule, *, costs: Costs | None = None,
               max_nodes: int = MAX_NODES) -> str:
    """DOT source: a cluster per rank, dashed grey order edges, black data edges, critical path
    in red; an invalid schedule's failing steps outlined in red and the message as the label."""
    count = sum(len(row) for row in schedule.actions)
    if count > max_nodes:
        raise ValueError(f"the dependency graph of {schedule.name} has {count} actions, more than "
                         f"{max_nodes} (graphviz would be slow and the picture unreadable): "
                         f"use fewer ranks or micro-batches, or raise --max-nodes")
    costs = costs or Costs()
    graph = dependency_graph(schedule)
    lay = layout(schedule, costs=costs)
    found = critical_path(graph, costs)
    path = found[0] if found else []
    on_path, path_edges = set(path), set(itertools.pairwise(path))
    marked = {(m.rank, m.step) for m in lay.failure.marks} if lay.failure else set()
    label = [f"{lay.title}: {lay.subtitle}"]
    if found is not None:
        label.append(f"critical path (red): length {format_number(found[1])}, the makespan")
    else:
        label.append("no critical path: the graph has a cycle (the schedule deadlocks)")
    if lay.failure is not None:
        label += ["INVALID: " + line for line in lay.failure.message.splitlines()]
    out = [
        "digraph schedule {",
        f"  graph [rankdir=LR, labelloc=t, fontname=Helvetica, fontsize=12, nodesep=0.12, "
        f"ranksep=0.25, label={_q(chr(10).join(label))}];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10, '
        "height=0.3, width=0.4, margin=0.04];",
        '  edge [arrowsize=0.5, color="#333333"];',
    ]
    for r, row in enumerate(schedule.actions):
        out.append(f"  subgraph cluster_rank{r} {{")
        out.append(f'    label="rank {r}"; color="#bbbbbb"; fontname=Helvetica;')
        for i, a in enumerate(row):
            kind = kind_of(a.op)
            attrs = [f"label={_q(str(a))}", f'fillcolor="{COLORS[kind]}"',
                     f"tooltip={_q(f'rank {r} step {i}: {KIND_NAMES[kind]}')}"]
            if (r, i) in marked:
                attrs.append(f'color="{MARK_COLOR}", penwidth=4, fontcolor="{MARK_COLOR}"')
            elif (r, i) in on_path:
                attrs.append(f'color="{MARK_COLOR}", penwidth=2.5')
            out.append(f"    r{r}s{i} [{', '.join(attrs)}];")
        out.append("  }")
    data = set(graph.data)
    for u, v in graph.order:
        if (u, v) in data:
            continue  # also a data edge: drawn once, as data
        extra = f', color="{MARK_COLOR}", penwidth=2.5' if (u, v) in path_edges else ""
        out.append(f'  r{u[0]}s{u[1]} -> r{v[0]}s{v[1]} [style=dashed, color="#aaaaaa"{extra}];')
    for u, v in graph.data:
        extra = f' [color="{MARK_COLOR}", penwidth=2.5]' if (u, v) in path_edges else ""
        out.append(f"  r{u[0]}s{u[1]} -> r{v[0]}s{v[1]}{extra};")
    for n, (name, (r, i)) in enumerate(graph.missing):
        out.append(f'  missing{n} [label={_q("missing " + name)}, fillcolor="#ffffff", '
                   f'color="{MARK_COLOR}", style="dashed"];')
        out.append(f'  missing{n} -> r{r}s{i} [color="{MARK_COLOR}", style=dashed];')
    out.append("}")
    return "\n".join(out) + "\n"


def dot_to_image(source: str, fmt: str) -> bytes | None:
    """Render DOT with the `graphviz` package and the `dot` program; None if either is absent."""
    try:
        import graphviz
    except ImportError:
        return None
    if shutil.which("dot") is None:
        return None
    try:
        data = graphviz.Source(source).pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        return None
    return bytes(data)
