"""PNG: the SVG's scene drawn directly with Pillow (no browser, no SVG rasteriser needed)."""

from __future__ import annotations

import io
import os
from functools import cache
from typing import Any

from schedules import Costs, Schedule, Timeline
from schedules.files import write_atomic
from viz.compare import Comparison
from viz.layout import Layout, layout
from viz.scene import IDLE_COLOR, Line, Rect, Scene, Text, build_scene

__all__ = ["render_png", "write_png"]

_FONTS = {  # (bold, mono) -> TrueType files tried in order; Pillow searches the system's font dirs
    (False, False): ("DejaVuSans.ttf", "LiberationSans-Regular.ttf", "Arial.ttf"),
    (True, False): ("DejaVuSans-Bold.ttf", "LiberationSans-Bold.ttf", "Arial Bold.ttf"),
    (False, True): ("DejaVuSansMono.ttf", "LiberationMono-Regular.ttf", "Courier New.ttf"),
    (True, True): ("DejaVuSansMono-Bold.ttf", "LiberationMono-Bold.ttf"),
}
_ANCHORS = {"start": "ls", "middle": "ms", "end": "rs"}  # horizontal position, on the baseline


def _pillow() -> Any:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise RuntimeError("PNG output needs Pillow: pip install 'pipeline-engine[viz]' "
                           "(or pip install pillow), or use --format svg") from None
    return Image, ImageDraw, ImageFont


@cache
def _font(size: float, bold: bool, mono: bool) -> Any:
    _, _, image_font = _pillow()
    for name in _FONTS[(bold, mono)]:
        try:
            return image_font.truetype(name, round(size))
        except OSError:
            continue
    # Pillow >= 10.1 ships a scalable default font, so text keeps its size without system fonts.
    return image_font.load_default(round(size))


def render_png(source: Timeline | Schedule | Layout | Comparison, *,
               costs: Costs | None = None, zoom: int = 2) -> bytes:
    """The picture `render_svg` draws, as PNG bytes, `zoom` pixels per SVG unit."""
    target = source if isinstance(source, Comparison) else layout(source, costs=costs)
    return scene_to_png(build_scene(target), zoom=zoom)


def write_png(source: Timeline | Schedule | Layout | Comparison,
              path: str | os.PathLike[str], *, costs: Costs | None = None,
              zoom: int = 2) -> None:
    """Write `render_png(source)` to `path`."""
    write_atomic(path, render_png(source, costs=costs, zoom=zoom))


def scene_to_png(scene: Scene, *, zoom: int = 2) -> bytes:
    image_mod, draw_mod, _ = _pillow()
    image = image_mod.new("RGB", (scene.width * zoom, scene.height * zoom), "#ffffff")
    draw = draw_mod.Draw(image)
    z = zoom
    for item in scene.items:
        if isinstance(item, Line):
            draw.line([(item.x1 * z, item.y1 * z), (item.x2 * z, item.y2 * z)],
                      fill=item.stroke, width=max(1, round(item.width * z)))
        elif isinstance(item, Rect):
            _rect(image, draw, item, z)
        elif isinstance(item, Text):
            draw.text((item.x * z, item.y * z), item.text, fill=item.fill,
                      font=_font(item.size * z, item.bold, item.mono),
                      anchor=_ANCHORS[item.anchor])
    buffer = io.BytesIO()
    image.save(buffer, "PNG", optimize=True)
    return buffer.getvalue()


def _rect(image: Any, draw: Any, r: Rect, z: int) -> None:
    x0, y0 = round(r.x * z), round(r.y * z)
    x1, y1 = round((r.x + r.w) * z), round((r.y + r.h) * z)
    if x1 <= x0 or y1 <= y0:
        return
    if r.hatch:
        _hatch(image, x0, y0, x1 - x0, y1 - y0, z)
    elif r.fill != "none":
        draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=r.fill)
    if r.stroke and r.stroke_width > 0:
        width = max(1, round(r.stroke_width * z))
        # SVG centres a stroke on the edge; Pillow draws it inside: grow by half to match.
        grow = width // 2
        draw.rectangle([x0 - grow, y0 - grow, x1 - 1 + grow, y1 - 1 + grow], outline=r.stroke,
                       width=width)


def _hatch(image: Any, x: int, y: int, w: int, h: int, z: int) -> None:
    image_mod, draw_mod, _ = _pillow()
    tile = image_mod.new("RGB", (w, h), IDLE_COLOR)
    pen = draw_mod.Draw(tile)
    step = round(6 * z * 1.414)  # the SVG pattern: 6-unit strokes rotated 45 degrees
    for k in range(-h, w + step, step):
        pen.line([(k, h), (k + h, 0)], fill="#cfcfcf", width=max(1, round(1.4 * z)))
    image.paste(tile, (x, y))
