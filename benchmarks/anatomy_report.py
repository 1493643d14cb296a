"""The anatomy's figures over the timed steps, and their tables (markdown, readable as text)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.anatomy_parts import (
    PARTS,
    PATH_PARTS,
    RankAnatomy,
    RankRecord,
    critical_path,
    excess,
    ideal_step,
    mean_anatomy,
    split_step,
)

__all__ = ["Summary", "render", "render_summary", "summarize_rounds", "trimmed"]

_NAMES = {"compute": "compute", "runtime": "runtime between actions",
          "wait": "waits for a peer", "sync": "syncs", "outside": "outside the schedule"}
_TOP = 3  # messages listed per rank


def trimmed(values: Sequence[float]) -> list[int]:
    """The indices of the middle half of `values` (all of them when there are fewer than 4):
    a shared machine's slowest and fastest steps left out, the rest averaged, so that the
    parts' means still add up to the step's."""
    order = sorted(range(len(values)), key=values.__getitem__)
    cut = len(values) // 4
    return sorted(order[cut:len(order) - cut])


@dataclass(frozen=True)
class Summary:
    """One configuration over its timed steps: per rank the mean anatomy and the mean compute
    alone (kept steps only), the ideal, and ours / ideal (as means, and the median of the
    per-round ratios: a step and the ideal measured beside it share the machine's state)."""

    num_microbatches: int
    num_ranks: int
    anatomies: tuple[RankAnatomy, ...]
    alone: tuple[float, ...]
    path: Mapping[str, float]  # the mean critical path by part (PATH_PARTS)
    ideal: float
    ratio: float
    paired_ratio: float
    kept: int
    rounds: int
    median_round: int  # the round whose step is the median: the one drawn

    @property
    def step(self) -> float:
        return self.anatomies[0].step

    def excess(self) -> list[dict[str, float]]:
        return [excess(a, alone, self.ideal) for a, alone in
                zip(self.anatomies, self.alone, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        return {"num_microbatches": self.num_microbatches, "num_ranks": self.num_ranks,
                "step_s": self.step, "ideal_s": self.ideal, "ours_over_ideal": self.ratio,
                "ours_over_ideal_paired": self.paired_ratio, "alone_s": list(self.alone),
                "kept_rounds": self.kept, "rounds": self.rounds,
                "median_round": self.median_round,
                "anatomy": [a.to_dict() for a in self.anatomies], "beyond_ideal_s": self.excess(),
                "critical_path_s": dict(self.path)}


def summarize_rounds(rounds: Sequence[tuple[Sequence[RankRecord], Sequence[float]]],
                     num_microbatches: int, stages_per_rank: int = 1) -> Summary:
    """Each round's step (every rank's record) and each rank's compute alone, taken in turn:
    the mean anatomy per rank over the middle half of the steps, and the ideal likewise."""
    if not rounds:
        raise ValueError("no timed rounds")
    p = len(rounds[0][1])
    steps = [split_step(records) for records, _ in rounds]
    walls = [s[0].step for s in steps]
    ideals = [ideal_step(alone, num_microbatches, p, stages_per_rank) for _, alone in rounds]
    keep, keep_ideal = trimmed(walls), trimmed(ideals)
    ranks = len(steps[0])
    means = tuple(mean_anatomy([steps[i][r] for i in keep]) for r in range(ranks))
    paths = [critical_path(rounds[i][0]) for i in keep]
    path = {k: statistics.fmean(pth[k] for pth in paths) for k in PATH_PARTS}
    alone = tuple(statistics.fmean(rounds[i][1][r] for i in keep_ideal) for r in range(p))
    ideal = statistics.fmean(ideals[i] for i in keep_ideal)
    order = sorted(range(len(walls)), key=walls.__getitem__)
    return Summary(num_microbatches, p, means, alone, path, ideal, means[0].step / ideal,
                   statistics.median(w / i for w, i in zip(walls, ideals, strict=True)),
                   len(keep), len(rounds), order[(len(order) - 1) // 2])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _cell(seconds: float, step: float) -> str:
    return f"{_ms(seconds)} ({seconds / step:.0%})" if step > 0 else _ms(seconds)


def _top(messages: Mapping[str, float]) -> str:
    best = sorted(messages.items(), key=lambda kv: -kv[1])[:_TOP]
    return ", ".join(f"{k} {_ms(v)}" for k, v in best) or "-"


def render(summary: Summary, title: str) -> str:
    """One configuration's table: per rank each part and its detail, in ms and share of the
    step; the compute alone, the ideal, and the step beyond it split by part."""
    s, anat = summary, summary.anatomies
    head = "| ms (share of the step) | " + " | ".join(f"rank {a.rank}" for a in anat) + " |"
    lines = [f"### {title}", "", head, "|---|" + "---|" * len(anat)]

    def row(label: str, values: Sequence[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    for part in PARTS:
        row(f"**{_NAMES[part]}**", [_cell(a.parts[part], a.step) for a in anat])
        keys: list[str] = []
        for a in anat:
            keys += [k for k in a.detail[part] if k not in keys]
        for key in keys:
            row(f"&nbsp;&nbsp;{key}", [_cell(a.detail[part].get(key, 0.0), a.step)
                                       for a in anat])
        if part == "wait":
            row("&nbsp;&nbsp;most waited for", [_top(a.messages) for a in anat])
    row("**step** (first call to last return)", [_ms(a.step) for a in anat])
    row("parts added up", [_ms(a.total) for a in anat])
    row("compute alone, every rank at once", [_ms(v) for v in s.alone])
    beyond = s.excess()
    row("**beyond the ideal**: compute - alone", [_ms(e["compute"]) for e in beyond])
    row("&nbsp;&nbsp;idle (waits, outside its call) - the ideal's (ideal - alone)",
        [_ms(e["wait"]) for e in beyond])
    for part in ("runtime", "sync"):
        row(f"&nbsp;&nbsp;{_NAMES[part]}", [_ms(e[part]) for e in beyond])
    row("&nbsp;&nbsp;outside the schedule, within its call", [_ms(e["outside"]) for e in beyond])
    row("&nbsp;&nbsp;step - ideal", [_ms(e["total"]) for e in beyond])
    path = ", ".join(f"{k} {_ms(v)}" for k, v in s.path.items())
    m, p = s.num_microbatches, s.num_ranks
    lines += ["", f"Along the critical path (ms): {path}.", "",
              f"Step {_ms(s.step)} ms, ideal {_ms(s.ideal)} ms (the slowest rank's compute "
              f"alone x (m + p - 1) / m = {m + p - 1}/{m}): ours / ideal {s.ratio:.3f} "
              f"(median of the per-round ratios {s.paired_ratio:.3f}); means over the "
              f"middle {s.kept} of {s.rounds} timed steps."]
    return "\n".join(lines)


def render_summary(summaries: Sequence[Summary]) -> str:
    """One row per configuration: step, ideal, ours / ideal, and the step beyond the ideal
    along its critical path (ms): the compute on the path beyond the ideal, messages in
    transit, the runtime between actions, syncs, and time outside the schedule."""
    lines = ["| m | step ms | ideal ms | ours / ideal | critical path: compute - ideal | "
             "messages in transit | runtime | syncs | outside |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        c = s.path
        lines.append(f"| {s.num_microbatches} | {_ms(s.step)} | {_ms(s.ideal)} | "
                     f"{s.ratio:.2f} | {_ms(c['compute'] - s.ideal)} | {_ms(c['transit'])} | "
                     f"{_ms(c['runtime'])} | {_ms(c['sync'])} | {_ms(c['outside'])} |")
    return "\n".join(lines)
