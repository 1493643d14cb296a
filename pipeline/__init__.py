"""Pipeline-parallel training of nn.Sequential models under any schedule from `schedules`."""

import logging

from pipeline.checkpoint import is_recomputing
from pipeline.pipe import Pipe, PipeConfigError, PipelineError

__all__ = ["Pipe", "PipeConfigError", "PipelineError", "is_recomputing"]

# A library logs, the application decides what is shown: silent unless logging is configured.
logging.getLogger(__name__).addHandler(logging.NullHandler())
