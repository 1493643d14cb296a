"""Pipeline-parallel training of nn.Sequential models under any schedule from `schedules`."""

from pipeline.checkpoint import is_recomputing
from pipeline.pipe import Pipe, PipeConfigError, PipelineError

__all__ = ["Pipe", "PipeConfigError", "PipelineError", "is_recomputing"]
