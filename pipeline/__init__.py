"""Pipeline-parallel training of nn.Sequential models under any schedule from `schedules`."""

import logging

from pipeline.errors import PipeConfigError, PipelineError
from pipeline.pipe import Pipe
from pipeline.planner import Plan, PlanError, plan
from pipeline.runtime.recompute import is_recomputing

__all__ = ["Pipe", "PipeConfigError", "PipelineError", "Plan", "PlanError", "is_recomputing",
           "plan"]

# A library logs, the application decides what is shown: silent unless logging is configured.
logging.getLogger(__name__).addHandler(logging.NullHandler())
