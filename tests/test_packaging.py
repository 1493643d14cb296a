"""Packaging: every folder of the shipped packages is in pyproject's package list."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the package supports 3.10)

ROOT = Path(__file__).resolve().parent.parent


def test_every_shipped_folder_is_a_listed_package() -> None:
    """Was: `pip install -e .` warned "Package 'benchmarks.data' is absent from the packages
    configuration", and a wheel left out `pipeline.planner` (not listed) altogether."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    tops = {name for name in listed if "." not in name}
    shipped = set()
    for top in tops:
        for folder in [ROOT / top, *(ROOT / top).rglob("*")]:
            if folder.is_dir() and (folder / "__init__.py").exists():
                shipped.add(".".join(folder.relative_to(ROOT).parts))
    for package, files in config["package-data"].items():
        folders = {".".join((package, *Path(f).parent.parts)).rstrip(".") for f in files}
        shipped |= {f for f in folders if not f.endswith(".")}
        for f in files:
            assert (ROOT / package.replace(".", "/") / f).is_file(), (package, f)
    assert shipped <= listed, f"not in [tool.setuptools] packages: {sorted(shipped - listed)}"
