"""SVG, written by hand: a time-scaled lane per rank, one box per action, bubbles shaded."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from schedules import Costs, Schedule, Timeline
from viz.compare import Comparison
from viz.layout import Layout, layout
from viz.scene import Line, Rect, Scene, Text, build_scene

__all__ = ["render_svg", "scene_to_svg"]

_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
_MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
# Bubbles: pale grey with thin diagonal strokes, visible in print and to the colour-blind.
_HATCH = (
    '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f1f1f1"/>'
    '<line x1="0" y1="0" x2="0" y2="6" stroke="#cfcfcf" stroke-width="2"/></pattern>'
)


def render_svg(source: Timeline | Schedule | Layout | Comparison, *,
               costs: Costs | None = None) -> str:
    """A standalone SVG document of a timeline, a schedule (under `costs`) or a comparison.

    Each action is one `<rect class="action op-K">` whose width is its duration times a fixed
    scale, with its facts in `data-rank`, `data-action`, `data-start`, `data-end`.
    """
    target = source if isinstance(source, Comparison) else layout(source, costs=costs)
    return scene_to_svg(build_scene(target))


def _num(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def scene_to_svg(scene: Scene) -> str:
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{scene.width}" height="{scene.height}" '
        f'viewBox="0 0 {scene.width} {scene.height}" font-family={quoteattr(_FONT)}>',
        f"<title>{escape(scene.title)}</title>",
        f"<defs>{_HATCH}</defs>",
        f'<rect width="{scene.width}" height="{scene.height}" fill="#ffffff"/>',
    ]
    for item in scene.items:
        if isinstance(item, Rect):
            out.append(_rect(item))
        elif isinstance(item, Text):
            out.append(_text(item))
        elif isinstance(item, Line):
            out.append(f'<line x1="{_num(item.x1)}" y1="{_num(item.y1)}" x2="{_num(item.x2)}" '
                       f'y2="{_num(item.y2)}" stroke="{item.stroke}" '
                       f'stroke-width="{_num(item.width)}"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _rect(r: Rect) -> str:
    attrs = [f'x="{_num(r.x)}" y="{_num(r.y)}" width="{_num(r.w)}" height="{_num(r.h)}"',
             f'fill="{"url(#hatch)" if r.hatch else r.fill}"']
    if r.stroke:
        attrs.append(f'stroke="{r.stroke}" stroke-width="{_num(r.stroke_width)}"')
    if r.cls:
        attrs.append(f"class={quoteattr(r.cls)}")
    attrs += [f"data-{key}={quoteattr(value)}" for key, value in r.data]
    if not r.tooltip:
        return f"<rect {' '.join(attrs)}/>"
    return f"<rect {' '.join(attrs)}><title>{escape(r.tooltip)}</title></rect>"


def _text(t: Text) -> str:
    attrs = [f'x="{_num(t.x)}" y="{_num(t.y)}" font-size="{_num(t.size)}"', f'fill="{t.fill}"']
    if t.anchor != "start":
        attrs.append(f'text-anchor="{t.anchor}"')
    if t.bold:
        attrs.append('font-weight="bold"')
    if t.mono:
        # Validator messages align columns with spaces: keep them, in a fixed-width font.
        attrs.append(f'font-family={quoteattr(_MONO)} xml:space="preserve"')
    return f"<text {' '.join(attrs)}>{escape(t.text)}</text>"
