"""A process whose process group broke exits without tearing the group down.

After a peer died, gloo can abort the surviving process at interpreter exit ("terminate called
after throwing an instance of 'gloo::IoException' ... Connection closed by peer"): a connection
to the dead peer fails while its context is destroyed, on a thread that cannot raise. The
process has already reported its `PipelineError`; what is left to tear down is a group that
cannot be used again. So once a transport records a failure (`arm()`), the exit runs the other
exit handlers, flushes, and ends the process with the code it would have had, skipping the
library teardown that could abort it. `PIPELINE_QUIET_EXIT=0` turns this off.

The exit code is what `sys.exit(code)`, `exit(code)` or `quit(code)` asked for, 1 after an
uncaught exception, else 0. A `SystemExit` raised directly (`raise SystemExit(main())`, as
`python -m pytest` ends) reaches no hook that could read its code: such an entry point calls
`record(code)` first, or the process ends with 0.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import logging
import os
import sys
from types import TracebackType
from typing import Any

from pipeline import settings

__all__ = ["ENV", "arm", "armed", "record"]

ENV = "PIPELINE_QUIET_EXIT"
_state: dict[str, Any] = {"armed": False, "code": 0}


def arm() -> None:
    """From now on, exit quietly (once per process; no-op with PIPELINE_QUIET_EXIT=0)."""
    # The setting is read every time: a bad value is refused even once armed.
    mode = settings.choice(ENV, {"1": "exit quietly", "0": "torch's own exit"}, default="1")
    if _state["armed"] or mode == "0":
        return
    _state["armed"] = True
    hook, exit_ = sys.excepthook, sys.exit

    def uncaught(kind: type[BaseException], value: BaseException,
                 tb: TracebackType | None) -> None:
        _state["code"] = 1  # as Python exits after an uncaught exception
        hook(kind, value, tb)

    def recorded_exit(code: Any = None) -> Any:
        _state["code"] = _exit_code(code)
        return exit_(code)

    sys.excepthook = uncaught
    sys.exit = recorded_exit
    for name in ("exit", "quit"):  # site's Quitter objects raise SystemExit themselves
        quitter = getattr(builtins, name, None)
        if quitter is not None:
            setattr(builtins, name, _recording(quitter))
    atexit.register(_exit)


def armed() -> bool:
    """Whether this process exits quietly (a transport recorded a failure)."""
    return bool(_state["armed"])


def record(code: Any) -> None:
    """The code a quiet exit ends with, for an entry point that ends by raising `SystemExit`
    itself (`sys.exit`, `exit` and uncaught exceptions are recorded already)."""
    _state["code"] = _exit_code(code)


def _recording(quitter: Any) -> Any:
    def recorded(code: Any = None) -> Any:
        record(code)
        return quitter(code)

    return recorded


def _exit_code(code: Any) -> int:
    """What Python makes of `sys.exit(code)`: None 0, an int itself, anything else 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _exit() -> None:
    atexit.unregister(_exit)
    atexit._run_exitfuncs()  # every other handler, as a normal exit would (LIFO)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to lose
            stream.flush()
    os._exit(_state["code"])
