"""Tensors handed to a torch.distributed collective come back once the backend has let go.

gloo runs a collective on a worker thread of its process group, and that thread drops its
reference to the work (and through it to the work's tensors) only after it has told the
waiting thread that the work is done: in about half of all collectives the caller's `wait()`
returns first. A tensor whose Python object is freed in that gap is kept alive by the worker,
its Python object with it, and the worker frees both. When that happens while the
interpreter finalises (a collective right before a script ends, the worker held off the CPU
by a loaded machine), the worker cannot take the GIL: Python ends the thread inside a C++
destructor and the process aborts ("terminate called without an active exception", SIGABRT,
after the script itself succeeded). So every collective of the pipeline, once its work is
done and the caller's own reference to the work dropped, waits until each tensor it handed
over is held by no more than before the call (`Handed.settle`): the backend's last reference
is gone, and Python frees the tensor on its own thread, whenever it does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["SETTLE_SECONDS", "Handed", "handed"]

# The worker lets go microseconds after the work is done, or once it gets a CPU back on a
# loaded machine: a hang guard, far above either.
SETTLE_SECONDS = 30.0
_log = logging.getLogger(__name__)


class Handed:
    """Tensors about to be handed to a collective, and how many references each has now
    (made before the collective is launched)."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._held = [(t, _references(t)) for t in tensors]

    def settle(self, timeout: float = SETTLE_SECONDS) -> None:
        """Wait until the backend holds none of the tensors (call it after the work is done
        and every reference to the work object is dropped)."""
        deadline = time.monotonic() + timeout
        pause = 0.0
        for tensor, count in self._held:
            while _references(tensor) > count:
                if time.monotonic() > deadline:
                    _log.warning("a collective's tensor is still held %gs after its work was "
                                 "done (references: %d, before the call: %d)", timeout,
                                 _references(tensor), count)
                    return
                # Asleep, without the GIL: the worker may need it to free what it holds.
                pause = min(pause * 2 + 1e-6, 1e-3)
                time.sleep(pause)
        self._held.clear()


def _references(tensor: torch.Tensor) -> int:
    """How many C++ references the tensor has (its Python object holds one of them)."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


@contextmanager
def handed(*tensors: torch.Tensor) -> Iterator[None]:
    """Run a blocking collective on `tensors` inside: on the way out the backend holds none
    of them. A collective that raised is left as it is (its group is broken)."""
    held = Handed(tensors)
    yield
    held.settle()
