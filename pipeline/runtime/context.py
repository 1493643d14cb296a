"""The caller's thread-local torch state (autocast, inference mode), carried to the rank threads.

Autocast and grad mode live in thread-local state: a rank worker thread sees none of what the
caller of `pipe(x)` or `pipe.step(...)` set up, so a user's `torch.autocast(...)` block would
silently run the pipeline in fp32 (torch's old Pipe had this bug). Pipe captures the state once
per call and every rank re-enters it: forwards (and their recomputation) and the loss under the
caller's autocast, the whole step under the caller's inference mode. Backward runs outside
autocast, as in plain training. Grad mode needs no carrying (`pipe(x)` never builds a graph and
the runtime sets it per action), and deterministic-algorithm settings are process-wide.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CallerState"]

_AUTOCAST_TYPES = ("cpu", "cuda")
_NOTHING = nullcontext()  # stateless: one serves every thread


@dataclass(frozen=True)
class CallerState:
    """What the calling thread had switched on; `capture` reads it, the context managers
    re-enter it on another thread."""

    inference: bool = False
    autocast: tuple[tuple[str, torch.dtype], ...] = ()  # (device type, dtype) where enabled
    autocast_cache: bool = True

    @classmethod
    def capture(cls) -> CallerState:
        enabled = tuple((t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_TYPES
                        if torch.is_autocast_enabled(t))
        return cls(torch.is_inference_mode_enabled(), enabled, torch.is_autocast_cache_enabled())

    def step(self) -> AbstractContextManager[Any]:
        """Around a rank's whole step: the caller's inference mode."""
        return torch.inference_mode() if self.inference else _NOTHING

    def forward(self) -> AbstractContextManager[None]:
        """Around a forward, its recomputation and the loss: the caller's autocast."""
        # Entered around every forward: without autocast, a shared no-op costs next to nothing.
        return self._autocast() if self.autocast else _NOTHING

    @contextmanager
    def _autocast(self) -> Iterator[None]:
        with ExitStack() as stack:
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                   cache_enabled=self.autocast_cache))
            yield
