"""Backward split in two: input gradients now (I), weight gradients later (W), without redoing work.

The I pass asks autograd only for the stage inputs' gradients, so it skips every weight-gradient
kernel. On the way it records the gradient arriving at each node where a parameter's branch
joins the input-to-output path; the W pass restarts autograd from exactly those nodes with the
recorded gradients and asks only for the parameters. Together they run the kernels of one fused
backward. (Same idea as torch.distributed.pipelining's stage_backward_input/weight.)

A branch may also reach an output without ever meeting that path: a position embedding or an
encoder's output handed on beside the decoder's, a bias made from parameters alone. The I pass
never runs such a branch (nothing in it leads to an input), so the W pass starts it from the
output itself, with the output's gradient: every path from a parameter to an output is then
walked exactly once, by one pass or the other. Nothing off the path can lead back onto it (a
node that depends on no input has no input below it), so the two starts never overlap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGrad", "backward_input", "backward_weight", "release", "run_backward"]


def release(outputs: Sequence[Any]) -> int:
    """Free the storage of stage outputs whose data went to the next stage (Megatron's
    `deallocate_output_tensor`): the backward needs only their autograd graph. Skips outputs
    that are views, leaves, or saved by their own backward (the storage would stay alive).
    Returns the bytes released. Their backward must then go through `run_backward`."""
    freed = 0
    for o in outputs:
        if (isinstance(o, torch.Tensor) and o.grad_fn is not None and o._base is None
                and not hasattr(o.grad_fn, "_saved_result") and o.numel() > 0):
            freed += o.numel() * o.element_size()
            o.data = torch.empty(0, dtype=o.dtype, device=o.device)
    return freed


def run_backward(outputs: Sequence[torch.Tensor | GradientEdge],
                 grads: Sequence[torch.Tensor], *, inputs: Sequence[torch.Tensor] = (),
                 accumulate: bool = True, keep_graph: bool = False
                 ) -> tuple[torch.Tensor | None, ...]:
    """autograd's engine, called without the Python-side shape checks of `backward`/`grad`,
    which a released output (`release`) would fail: its gradient keeps the real shape. The
    outputs may be gradient edges (the W pass starts from the I pass's join nodes)."""
    engine = torch.autograd.Variable._execution_engine
    result: tuple[torch.Tensor | None, ...] = engine.run_backward(
        tuple(outputs), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)
    return result


def _node(t: torch.Tensor) -> Node | None:
    """The autograd node a tensor's gradient flows into (its AccumulateGrad for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    return None


@dataclass
class WeightGrad:
    """What the W pass needs: groups of (join nodes, their parameters), the recorded gradients."""

    params: list[torch.Tensor]
    groups: list[tuple[list[Node], list[torch.Tensor]]] = field(default_factory=list)
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    # Outputs off the input-to-output path, by node: (output number, the output's gradient).
    seeds: dict[Node, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    fallback: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (outputs, grads)


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Reverse edges: for each node, the nodes whose backward feeds it."""
    reverse: dict[Node, list[Node]] = {}
    queue, seen = deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            reverse.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return reverse


def _upward(starts: list[Node], reverse: dict[Node, list[Node]], stop: set[Node],
            report: frozenset[Node] = frozenset()) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `starts` towards the outputs; stops at (and reports) `stop` nodes,
    and reports the `report` nodes it passes."""
    seen, hit = set(starts), set(report.intersection(starts))
    queue = deque(starts)
    while queue:
        for up in reverse.get(queue.popleft(), ()):
            if up in stop:
                hit.add(up)
            elif up not in seen:
                seen.add(up)
                queue.append(up)
                if up in report:
                    hit.add(up)
    return seen, hit


def backward_input(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                   inputs: Sequence[Any], params: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], WeightGrad]:
    """Input gradients of `inputs` (None where an input needs none) and the W pass's state."""
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    state = WeightGrad([p for p in params if p.requires_grad])
    if not wanted:
        # Nothing flows to the previous stage: the whole backward is weight work, done in W.
        state.fallback = (list(outputs), list(grad_outputs))
        return [None] * len(inputs), state
    edges = [(get_gradient_edge(o), g) for o, g in zip(outputs, grad_outputs, strict=True)]
    reverse = _consumers([edge.node for edge, _ in edges])
    on_path, _ = _upward([n for n in map(_node, wanted) if n is not None], reverse, set())
    for edge, g in edges:
        if edge.node not in on_path:
            state.seeds.setdefault(edge.node, []).append((edge.output_nr, g))
    state.groups = _group(state.params, reverse, on_path, frozenset(state.seeds))
    handles = []
    for join in (j for joins, _ in state.groups for j in joins):
        def record(grads: tuple[torch.Tensor | None, ...], join: Node = join) -> None:
            state.grads[join] = grads
        handles.append(join.register_prehook(record))
    try:
        grads = run_backward(outputs, grad_outputs, inputs=wanted, accumulate=False,
                             keep_graph=True)
    finally:
        for h in handles:
            h.remove()
    by_id = {id(t): g for t, g in zip(wanted, grads, strict=True)}
    return [by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in inputs], state


def _group(params: list[torch.Tensor], reverse: dict[Node, list[Node]], on_path: set[Node],
           seeded: frozenset[Node]) -> list[tuple[list[Node], list[torch.Tensor]]]:
    """Parameters grouped by the nodes the W pass starts from to reach them: the join nodes
    on the input-to-output path, and the `seeded` outputs off it (a parameter used twice joins
    twice).

    The W pass runs one autograd call per group asking for that group's parameters only, so
    autograd never walks the input-gradient chain between joins again.
    """
    groups: list[tuple[set[Node], list[torch.Tensor]]] = []
    for p in params:
        node = _node(p)
        if node is None:
            continue
        _, joins = _upward([node], reverse, on_path, seeded)
        merged = (set(joins), [p])
        for g in [g for g in groups if g[0] & joins]:
            merged[0].update(g[0])
            merged[1].extend(g[1])
            groups.remove(g)
        groups.append(merged)
    return [(list(j), ps) for j, ps in groups if j]


def backward_weight(state: WeightGrad) -> None:
    """Accumulate the parameters' gradients into `.grad`, freeing what only W needed."""
    if state.fallback is not None:
        outs, grads = state.fallback
        run_backward(outs, grads, inputs=state.params)
        return
    for joins, params in state.groups:
        edges, grads_out, pinned = [], [], []
        for join in joins:
            for nr, seed in state.seeds.get(join, ()):
                edges.append(GradientEdge(join, nr))
                grads_out.append(seed)
            recorded = state.grads.get(join)
            if recorded is None:
                continue
            for i, g in enumerate(recorded):
                if g is not None:
                    edges.append(GradientEdge(join, i))
                    grads_out.append(g)
            # A join below another of its group would also receive the upper one's
            # contribution in this pass: pin its incoming gradient to what I recorded.
            pinned.append(join.register_prehook(lambda _g, rec=recorded: rec))
        try:
            if edges:
                # The engine itself, as for the I pass: autograd.grad's Python checks of the
                # recorded gradients cost more than a small layer's kernels.
                dws = run_backward(edges, grads_out, inputs=params, accumulate=False,
                                   keep_graph=True)
                for p, dw in zip(params, dws, strict=True):
                    if dw is None:
                        continue
                    if p.grad is None:
                        # As autograd's accumulation: keep the gradient only if it is laid out
                        # as the parameter and owns its memory (an expand's gradient is a
                        # broadcast view, a seed's may be the next stage's own tensor).
                        p.grad = (dw if dw._base is None and dw.stride() == p.stride()
                                  else torch.empty_like(p).copy_(dw))
                    else:
                        p.grad.add_(dw)  # in place, as autograd's own accumulation does
        finally:
            for h in pinned:
                h.remove()
    state.groups.clear()
    state.grads.clear()
    state.seeds.clear()
