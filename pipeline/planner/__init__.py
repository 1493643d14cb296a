"""Planning: choose balance, schedule, micro-batches, recomputation and dp x pp for a budget."""

from pipeline.planner.costs import LayerCosts, ModelProfile, measure_contention, profile_model
from pipeline.planner.link import Link, measure_link
from pipeline.planner.plan import Plan, PlanError, format_bytes, format_table, plan
from pipeline.planner.search import predict
from pipeline.planner.space import Candidate

__all__ = ["Candidate", "LayerCosts", "Link", "ModelProfile", "Plan", "PlanError",
           "format_bytes", "format_table", "measure_contention", "measure_link", "plan",
           "predict", "profile_model"]
