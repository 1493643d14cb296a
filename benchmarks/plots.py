"""Pictures of a run: measured timelines drawn by the visualizer, and step time against m."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import viz
from schedules import Timeline
from schedules.files import write_atomic

__all__ = ["Series", "best_and_worst", "line_chart_svg", "write_plots"]

Record = dict[str, Any]
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


@dataclass(frozen=True)
class Series:
    """One line: its label, points (x, y), colour and dash pattern ("" for solid)."""

    label: str
    points: tuple[tuple[float, float], ...]
    color: str = "#333333"
    dash: str = ""


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    for f in (1, 2, 5, 10):
        if raw <= f * step:
            step *= f
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def line_chart_svg(series: Sequence[Series], *, title: str, x_label: str, y_label: str,
                   log2_x: bool = True, width: int = 760, height: int = 420) -> str:
    """A standalone SVG line chart (x on a log2 axis by default, y from zero)."""
    left, right, top, bottom = 64, 210, 44, 48
    plot_w, plot_h = width - left - right, height - top - bottom
    points = [pt for s in series for pt in s.points]
    if not points:
        raise ValueError("a line chart needs at least one point")
    fx = (lambda v: math.log2(v)) if log2_x else (lambda v: v)
    xs = sorted({x for x, _ in points})
    x0, x1 = fx(xs[0]), fx(xs[-1])
    y1 = max(y for _, y in points) * 1.08 or 1.0

    def px(x: float) -> float:
        return left + (0.5 if x1 == x0 else (fx(x) - x0) / (x1 - x0)) * plot_w

    def py(y: float) -> float:
        return top + plot_h - y / y1 * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="16" y="26" font-size="15" font-weight="bold">{escape(title)}</text>']
    for t in _ticks(0.0, y1):
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + plot_w}" y2="{py(t):.1f}" '
                   f'stroke="#e6e6e6"/>')
        out.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" font-size="11" '
                   f'text-anchor="end">{t:g}</text>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{top + plot_h + 16}" font-size="11" '
                   f'text-anchor="middle">{x:g}</text>')
    out.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" '
               f'y2="{top + plot_h}" stroke="#666666"/>')
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 10}" font-size="12" '
               f'text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text x="14" y="{top + plot_h / 2:.1f}" font-size="12" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + plot_h / 2:.1f})">{escape(y_label)}</text>')
    for i, s in enumerate(series):
        pts = sorted(s.points)
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        out.append(f'<polyline class="series" data-label="{escape(s.label)}" points="{path}" '
                   f'fill="none" stroke="{s.color}" stroke-width="2"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{s.color}"/>')
        ly = top + 14 + 18 * i
        lx = left + plot_w + 16
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 24}" y2="{ly - 4}" '
                   f'stroke="{s.color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 30}" y="{ly}" font-size="11">{escape(s.label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def best_and_worst(records: Sequence[Record]) -> tuple[Record, Record] | None:
    """The configurations with the highest and lowest speedup over the plain model on one
    thread (among those with two ranks or more, if any), or None when none has that figure."""
    scored = [r for r in records if r["ratios"].get("speedup_vs_plain_1_thread") is not None]
    multi = [r for r in scored if r["config"]["num_ranks"] > 1]
    pool = multi or scored
    if not pool:
        return None
    key = lambda r: r["ratios"]["speedup_vs_plain_1_thread"]  # noqa: E731
    return max(pool, key=key), min(pool, key=key)


def _safe(text: str) -> str:
    return text.replace("/", "_")


def _sweep_series(records: Sequence[Record], model: str, method: str, transport: str,
                  p: int) -> list[Series]:
    chosen = [r for r in records if (r["config"]["model"], r["config"]["balance_method"],
                                     r["config"]["transport"], r["config"]["num_ranks"])
              == (model, method, transport, p)]
    schedules = list(dict.fromkeys(r["config"]["schedule"] for r in chosen))
    out: list[Series] = []
    for i, s in enumerate(schedules):
        color = _PALETTE[i % len(_PALETTE)]
        rows = [r for r in chosen if r["config"]["schedule"] == s]
        out.append(Series(f"ours {s}", tuple((r["config"]["num_microbatches"],
                                              r["step_time_s"]["median"] * 1e3) for r in rows),
                          color))
        theirs = tuple((r["config"]["num_microbatches"], r["torch"]["step_time_s"]["median"]
                        * 1e3) for r in rows if r["torch"]["step_time_s"] is not None)
        if theirs:
            out.append(Series(f"torch {s}", theirs, color, "6 4"))
    plain = {r["config"]["num_microbatches"]: r["baselines"]["plain_1_thread_s"]
             for r in chosen if r["baselines"]["plain_1_thread_s"] is not None}
    if plain:
        out.append(Series("plain, 1 thread", tuple((m, v["median"] * 1e3)
                                                   for m, v in plain.items()), "#555555", "2 3"))
    bound = {r["config"]["num_microbatches"]: r["baselines"]["hardware_bound_s"]
             for r in chosen if r["config"]["schedule"] == schedules[0]
             and r["baselines"]["hardware_bound_s"] is not None}
    if bound:
        out.append(Series("hardware bound", tuple((m, v["min"] * 1e3)
                                                  for m, v in bound.items()), "#000000", "1 3"))
    return out


def write_plots(out_dir: Path, records: Sequence[Record],
                timelines: Mapping[str, Timeline]) -> list[Path]:
    """Draw into `out_dir`: the median-step timelines of the configurations with the highest
    and lowest speedup over the plain model on 1 thread (SVG, and PNG when Pillow is
    installed), and per model, step time against micro-batches (a line chart, and the
    visualizer's comparison of 1f1b's timelines across m). Returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    pair = best_and_worst(records)
    if pair is not None:
        for name, record in zip(("best", "worst"), pair, strict=True):
            tl = timelines.get(record["id"])
            if tl is None:
                continue
            title = (f"{name}: {record['id']} ("
                     f"{record['ratios']['speedup_vs_plain_1_thread']:.2f}x the plain model "
                     f"on 1 thread)")
            lay = viz.layout(tl, title=title)
            path = out_dir / f"{name}.svg"
            write_atomic(path, viz.render_svg(lay))
            written.append(path)
            try:
                viz.write_png(lay, out_dir / f"{name}.png")
                written.append(out_dir / f"{name}.png")
            except RuntimeError:  # no Pillow: the SVG is enough
                pass
    groups = dict.fromkeys((r["config"]["model"], r["config"]["balance_method"],
                            r["config"]["transport"], r["config"]["num_ranks"]) for r in records)
    for model, method, transport, p in groups:
        if p < 2 and any(g[0] == model and g[3] > 1 for g in groups):
            continue
        series = _sweep_series(records, model, method, transport, p)
        if not any(len(s.points) > 1 for s in series):
            continue
        stem = f"step_time_vs_m_{model}_{method}_{transport}_p{p}"
        path = out_dir / f"{stem}.svg"
        write_atomic(path, line_chart_svg(series, title=f"{model} ({method}), {transport}, "
                                          f"p={p}: step time against micro-batches",
                                          x_label="micro-batches (m)", y_label="step time (ms)"))
        written.append(path)
        sweep = sorted((r for r in records if r["config"]["schedule"] == "1f1b"
                        and (r["config"]["model"], r["config"]["balance_method"],
                             r["config"]["transport"], r["config"]["num_ranks"])
                        == (model, method, transport, p)),
                       key=lambda r: r["config"]["num_microbatches"])
        layouts = [viz.layout(timelines[r["id"]], title=f"m = {r['config']['num_microbatches']}")
                   for r in sweep if r["id"] in timelines]
        if len(layouts) > 1:
            path = out_dir / f"timelines_vs_m_{model}_{method}_{transport}_p{p}.svg"
            write_atomic(path, viz.render_svg(viz.compare(
                layouts, title=f"{model}, 1f1b, {transport}, p={p}: measured median steps")))
            written.append(path)
    return written
