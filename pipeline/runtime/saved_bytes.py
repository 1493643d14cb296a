"""Counting what autograd saves for backward: the activation memory a forward leaves behind."""

from __future__ import annotations

from types import TracebackType

import torch
from torch import nn

__all__ = ["SavedBytes"]


class SavedBytes:
    """Context manager: `bytes` is what autograd saved inside it (parameters and views of
    them excluded, since they are memory the model holds anyway). Hooks are thread-local, so
    each worker counts only its own forwards."""

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # A view of a parameter (Linear saves `weight.t()`) is the parameter's memory too.
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
            self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, value, tb)
