"""Packaging: every folder of the shipped packages is in pyproject's package list, and what the
README imports ships (the benchmarks do not)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
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


def _readme_imports() -> list[str]:
    """The import lines of the README's Python blocks (what a user copies first)."""
    text = (ROOT / "README.md").read_text("utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
            if re.match(r"(import|from) \w", line)]


def test_benchmarks_is_not_a_shipped_package() -> None:
    """Was: the wheel installed `benchmarks` as a top-level package, which a user's own
    `benchmarks/` folder shadows (or which shadows theirs)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = [*config["packages"], *config["package-data"]]
    assert not [p for p in shipped if p.split(".")[0] == "benchmarks"], shipped


@pytest.mark.slow
def test_the_readme_imports_resolve_from_the_installed_wheel(tmp_path: Path) -> None:
    """Was: the README's first example imported `benchmarks.demo` and `benchmarks.gpt`. The
    wheel, built and installed apart from the checkout, ships no `benchmarks` and runs every
    import of the README's examples, and loads the example's text, from a directory holding a
    `benchmarks/` of the user's own."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for name in ("schedules", "pipeline", "viz", "benchmarks"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
        timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert not [n for n in names if n.startswith("benchmarks/")]
    assert "pipeline/examples/data/shakespeare.txt" in names
    installed = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)  # what pip install puts in site-packages
    user = tmp_path / "user"
    (user / "benchmarks").mkdir(parents=True)
    (user / "benchmarks" / "__init__.py").write_text("MINE = True\n")
    imports = _readme_imports()
    assert "from pipeline.examples.gpt import gpt, lm_loss" in imports
    script = "\n".join([*imports, "import benchmarks, pipeline",
                        "assert benchmarks.MINE and pipeline.__file__.startswith(INSTALLED)",
                        "assert load_text().startswith('First Citizen:')"])
    env = {**os.environ, "PYTHONPATH": str(installed)}
    run = subprocess.run([sys.executable, "-c", f"INSTALLED = {str(installed)!r}\n{script}"],
                         cwd=user, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
