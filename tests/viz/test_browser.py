"""A real headless browser renders the SVG: boxes appear where and in the colour we drew them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import schedules
from viz import render_svg
from viz.layout import layout
from viz.scene import Rect, build_scene

Image = pytest.importorskip("PIL.Image")
BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome", "chrome")
                if shutil.which(b)), None)


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no chromium (apt-get install -y chromium)")
def test_chromium_draws_the_boxes(tmp_path: Path) -> None:
    schedule = schedules.get_schedule("zb-h1", 4, 8)
    svg, shot = tmp_path / "zb.svg", tmp_path / "zb.png"
    svg.write_text(render_svg(schedule))
    scene = build_scene(layout(schedule))
    assert BROWSER is not None
    # --no-sandbox: CI containers run as root, where chromium's sandbox refuses to start.
    subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={scene.width},{scene.height}", f"--screenshot={shot}",
                    svg.as_uri()], check=True, capture_output=True, timeout=120)
    image = Image.open(shot).convert("RGB")
    boxes = [r for r in scene.items if isinstance(r, Rect) and r.cls.startswith("action")]
    assert len(boxes) == 96
    for box in boxes:
        got = image.getpixel((round(box.x + 2), round(box.y + 3)))
        want = tuple(int(box.fill[i:i + 2], 16) for i in (1, 3, 5))
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 4, box.data
    # Somewhere on the page the bubbles' pale hatch shows too.
    assert (0xF1, 0xF1, 0xF1) in {c for _, c in image.getcolors(1 << 20) or []}
