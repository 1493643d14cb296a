"""pipeviz: draw any pipeline schedule, planned or measured: text, SVG, PNG, Chrome trace, DOT."""

from __future__ import annotations

from viz.cli import main
from viz.compare import Comparison, compare
from viz.layout import Layout, layout
from viz.render_dot import render_dot
from viz.render_png import write_png
from viz.render_svg import render_svg
from viz.render_text import render_text

__all__ = [
    "Comparison",
    "Layout",
    "compare",
    "layout",
    "main",
    "render_dot",
    "render_svg",
    "render_text",
    "write_png",
]
