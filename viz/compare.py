"""Several timelines on one time axis, with a table of makespan, bubble and peak activations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schedules import Costs, Schedule, Timeline
from viz.layout import Layout, format_costs, format_number, layout, time_scale

__all__ = ["Comparison", "compare"]


@dataclass(frozen=True)
class Comparison:
    """Layouts to stack on a shared time axis (same unit), best figures marked in the table."""

    title: str
    subtitle: str
    layouts: tuple[Layout, ...]
    # Schedules set against each other: the table stars the best. False for one step drawn
    # twice (measured over predicted), where there is nothing to choose between.
    ranked: bool = True

    @property
    def span(self) -> float:
        return max(lay.span for lay in self.layouts)

    @property
    def unit(self) -> str:
        units = {lay.unit for lay in self.layouts}
        return "cost" if units == {"cost", "step"} else units.pop()

    def table(self) -> list[tuple[str, str, str, str]]:
        """Header and one row per layout: name, makespan, bubble, peak activations per rank.

        The smallest makespan, bubble and largest peak are starred (ties all get a star), so
        the table reads as a choice: what each schedule buys and what it costs in memory
        (only where schedules are compared: `ranked`).
        """
        factor, suffix = time_scale(self.unit, self.span)
        timed = [lay for lay in self.layouts if lay.bubble is not None]
        best_span = min((lay.makespan for lay in timed), default=None)
        best_bubble = min((lay.bubble for lay in timed if lay.bubble is not None), default=None)
        best_peak = min((max(ln.peak for ln in lay.lanes) for lay in self.layouts), default=None)
        rows = [("schedule", f"makespan ({suffix})", "bubble", "peak activations (per rank)")]
        for lay in self.layouts:
            peak = max(ln.peak for ln in lay.lanes)
            if lay.bubble is None:
                span, bubble = "-", "invalid"
            else:
                span = (format_number(lay.makespan * factor)
                        + _star(self.ranked and lay.makespan == best_span))
                bubble = f"{lay.bubble:.1%}" + _star(self.ranked and lay.bubble == best_bubble)
            peaks = "/".join(str(ln.peak) for ln in lay.lanes)
            best = _star(self.ranked and peak == best_peak)
            rows.append((lay.title, span, bubble, f"{peak}{best} ({peaks})"))
        return rows

    def unit_name(self) -> str:
        """The time axis's unit as drawn (ms for a measured step of a few ms)."""
        return time_scale(self.unit, self.span)[1]


def _star(best: bool) -> str:
    return " *" if best else ""


def compare(sources: Sequence[Timeline | Schedule | Layout], *, costs: Costs | None = None,
            title: str | None = None, subtitle: str | None = None,
            ranked: bool = True) -> Comparison:
    """Lay out each source; refuse to put measured seconds and planned costs on one axis.

    `costs` are those of one rank's share of the model: a schedule with v stages per rank
    (interleaved) runs each stage at 1/v of them, so every schedule does the same work and
    the makespans compare. Communication latency is per transfer and stays as given.
    """
    if not sources:
        raise ValueError("compare needs at least one schedule or timeline")
    costs = costs or Costs()
    layouts = tuple(
        layout(s, costs=_share(costs, s.stages_per_rank) if isinstance(s, Schedule) else costs)
        for s in sources)
    measured = {lay.unit == "s" for lay in layouts}
    if len(measured) > 1:
        raise ValueError("cannot compare measured timelines (seconds) with planned ones (cost "
                         "units) on one time axis; compare like with like")
    if subtitle is None:
        ranks = sorted({lay.num_ranks for lay in layouts})
        subtitle = "/".join(map(str, ranks)) + " ranks; " + (
            "measured" if measured == {True} else f"costs per rank {format_costs(costs)}")
    return Comparison(title or " vs ".join(lay.title for lay in layouts), subtitle, layouts,
                      ranked)


def _share(costs: Costs, stages_per_rank: int) -> Costs:
    """`costs` of a rank's work split over its `stages_per_rank` stages."""
    if stages_per_rank == 1:
        return costs
    v = stages_per_rank

    def split(value: float | Sequence[float]) -> float | tuple[float, ...]:
        return value / v if isinstance(value, int | float) else tuple(x / v for x in value)

    return Costs(forward=split(costs.forward), backward=split(costs.backward),
                 backward_input=split(costs.backward_input),
                 backward_weight=split(costs.backward_weight), update=split(costs.update),
                 comm=costs.comm)
