"""`make test`'s runs on torch's other CPU kernels (tests/cpu_paths.py) check what they say."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import cpu_paths

ROOT = Path(__file__).resolve().parent.parent


def test_torch_honours_the_variable_so_the_default_kernels_really_run() -> None:
    """Every x86 and Arm CPU has the plain kernels: if torch stopped reading
    ATEN_CPU_CAPABILITY, the extra runs would repeat the native ones and prove nothing."""
    assert cpu_paths.runs_as("default") == "default"
    assert cpu_paths.native() in {"default", "avx2", "avx512", "zvector", "sve256"}


def test_every_sensitive_test_named_exists() -> None:
    for node in cpu_paths.SENSITIVE:
        path, _, name = node.partition("::")
        name = name.partition("[")[0]
        assert (ROOT / path).is_file(), path
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), node


def test_an_unknown_kernel_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cpu_paths.main(["avx9"]) == 2
    assert "choose from ['default', 'avx2', 'avx512']" in capsys.readouterr().err
