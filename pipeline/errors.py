"""The errors Pipe raises for arguments, inputs and ranks that cannot work together."""

from __future__ import annotations

__all__ = ["PipeConfigError", "PipeTypeError", "PipelineError"]


class PipeConfigError(ValueError):
    """Pipe was built or called with arguments that cannot work together."""


class PipeTypeError(PipeConfigError, TypeError):
    """An argument of the wrong type (a `TypeError` as well as a `PipeConfigError`)."""


class PipelineError(RuntimeError):
    """A stage failed during a step; the message names its rank, stage, action and micro-batch."""
