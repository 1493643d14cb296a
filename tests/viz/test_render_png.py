"""PNG: Pillow draws the SVG's scene; boxes land where the scene puts them, in their colours."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import schedules
from viz import compare, write_png
from viz.layout import layout
from viz.render_png import render_png
from viz.scene import COLORS, Rect, build_scene

Image = pytest.importorskip("PIL.Image")


def _hex(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def test_boxes_are_drawn_in_their_colours(tmp_path: Path) -> None:
    schedule = schedules.get_schedule("zb-h1", 3, 4)
    path = tmp_path / "zb.png"
    write_png(schedule, path, zoom=2)
    image = Image.open(path).convert("RGB")
    scene = build_scene(layout(schedule))
    assert image.size == (scene.width * 2, scene.height * 2)
    boxes = [r for r in scene.items if isinstance(r, Rect) and r.cls.startswith("action")]
    assert len(boxes) == 36
    for box in boxes:
        # Sample near the box's top left corner, clear of the white border and the label.
        x, y = round((box.x + 2) * 2), round((box.y + 3) * 2)
        assert image.getpixel((x, y)) == _hex(box.fill), box.data


def test_hatched_bubbles_and_white_background() -> None:
    data = render_png(schedules.get_schedule("gpipe", 2, 2), zoom=1)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    assert image.getpixel((2, 2)) == (255, 255, 255)
    scene = build_scene(layout(schedules.get_schedule("gpipe", 2, 2)))
    bubble = next(r for r in scene.items if isinstance(r, Rect) and r.cls == "bubble")
    inside = {image.getpixel((round(bubble.x) + dx, round(bubble.y) + dy))
              for dx in range(1, round(bubble.w) - 1) for dy in range(1, round(bubble.h) - 1)}
    assert {_hex("#f1f1f1"), _hex("#cfcfcf")} <= inside  # pale fill and its diagonal strokes
    assert _hex(COLORS["F"]) not in inside


def test_comparison_png_is_taller_than_one_schedule() -> None:
    one = Image.open(io.BytesIO(render_png(schedules.get_schedule("1f1b", 4, 8), zoom=1)))
    both = Image.open(io.BytesIO(render_png(compare(
        [schedules.get_schedule(n, 4, 8) for n in ("1f1b", "zb-h1")]), zoom=1)))
    assert both.size[0] == one.size[0] and both.size[1] > one.size[1] + 4 * 30
