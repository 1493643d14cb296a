"""Busy processes on every core, as on a laptop or a shared runner: for a test, or a whole run.

A test that passes only on an idle machine hides defects that only load shows (a rank that
aborts at exit when a backend thread is held off the CPU) and reports false ones (a timing
that only an idle machine gives). `busy_cores()` keeps one spinning process per core (or
`count`) running while its block runs and stops them however it ends; the `busy` fixture
(tests/conftest.py) wraps a test in it. `python -m tests.busy CMD...` runs a command beside
them (`make test-busy` runs `make test` that way) and exits with the command's status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from types import FrameType

__all__ = ["busy_cores", "exit_repeat", "main"]

# Spins until its parent is gone: a runner killed outright leaves no busy process behind.
_SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def exit_repeat() -> int:
    """How many times the exit checks launch their fresh interpreters (tests/test_exit.py, and
    the docs' multi-process examples, tests/test_docs.py), as a multiple of their least:
    `TEST_EXIT_REPEAT` (default 1; `make test-busy` sets 3). An abort at exit is rare: every
    `make test` runs each check, and more launches look for one in a single run."""
    repeat = int(os.environ.get("TEST_EXIT_REPEAT", "1"))
    if repeat < 1:
        raise ValueError(f"TEST_EXIT_REPEAT must be 1 or more, got {repeat}")
    return repeat


@contextlib.contextmanager
def busy_cores(count: int | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` (default: one per core) processes that spin while the block runs."""
    n = count if count is not None else os.cpu_count() or 1
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN],
                                          stdin=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command `argv` beside one busy process per core; return its exit status."""
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m tests.busy COMMAND [ARGS...]", file=sys.stderr)
        return 2

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # through busy_cores' cleanup

    signal.signal(signal.SIGTERM, stop)
    with busy_cores() as procs:
        print(f"tests.busy: {len(procs)} busy processes beside: {' '.join(command)}",
              file=sys.stderr, flush=True)
        return subprocess.call(command)


if __name__ == "__main__":
    raise SystemExit(main())
