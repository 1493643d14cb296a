"""Pipeline-parallel training of any model (nn.Sequential, or split from its graph) under any
schedule from `schedules`."""

import logging

from pipeline.errors import PipeConfigError, PipelineError
from pipeline.pipe import Pipe
from pipeline.planner import Plan, PlanError, plan
from pipeline.runtime.recompute import is_recomputing
from pipeline.splitting.split import split
from pipeline.splitting.traced import SplitModel

__all__ = ["Pipe", "PipeConfigError", "PipelineError", "Plan", "PlanError", "SplitModel",
           "is_recomputing", "plan", "split"]

# A library logs, the application decides what is shown: silent unless logging is configured.
logging.getLogger(__name__).addHandler(logging.NullHandler())
