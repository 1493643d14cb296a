"""Another local user beside the job (uid 65534, 'nobody'), as on any shared machine.

The docs say other users are not trusted. Tests that check what such a user can read, plant or
jam run its code in a separate interpreter under that uid, which needs root; elsewhere they
skip with the reason. Its code is plain standard-library Python (it imports nothing of ours):
what it can do is what any process of that user could.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

__all__ = ["OTHER_UID", "other_user", "run_as_other", "shared_dir", "start_as_other"]

OTHER_UID = 65534  # 'nobody' on Debian and most distributions


def _open_to_all(path: str) -> bool:
    """Whether any user may run `path`: it and every directory above it are open to others."""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.stat(real).st_mode & 0o001:
        return False
    parent = os.path.dirname(real)
    while parent != os.path.dirname(parent):
        if not os.stat(parent).st_mode & 0o001:
            return False
        parent = os.path.dirname(parent)
    return True


def _interpreter() -> str | None:
    """A Python the other user may run (this one may live under root's home)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if _open_to_all(candidate):
            return candidate
    return None


def _why_not() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to run code as another user (uid 65534)"
    if _interpreter() is None:
        return "no Python interpreter that another user may run"
    return None


other_user = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _command(code: str, args: tuple[str, ...]) -> list[str]:
    # -I: isolated (no user site, no PYTHON* variables, not this checkout on sys.path)
    interpreter = _interpreter()
    assert interpreter is not None, "guarded by the other_user marker"
    return [interpreter, "-I", "-c", code, *args]


def run_as_other(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run `code` (standard-library Python; `sys.argv[1:]` are `args`) as the other user to
    its end; its output as text. Raises if it runs longer than `timeout` seconds."""
    return subprocess.run(_command(code, args), user=OTHER_UID, group=OTHER_UID,
                          extra_groups=[], capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin"}, cwd="/")


def start_as_other(code: str, *args: str) -> subprocess.Popen[str]:
    """Start `code` as the other user, in the background (the caller ends it)."""
    return subprocess.Popen(_command(code, args), user=OTHER_UID, group=OTHER_UID,
                            extra_groups=[], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={"PATH": "/usr/bin:/bin"}, cwd="/")


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A directory both users may create entries in, sticky as /tmp (mode 1777), as a shared
    scratch or project directory is: each user may remove only its own entries."""
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    path = tempfile.mkdtemp(prefix="pipeline-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", path], check=False)
