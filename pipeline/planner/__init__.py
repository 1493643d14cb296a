"""Planning: balance, schedule, micro-batches, recomputation and dp x pp x tp for a budget."""

from pipeline.planner.costs import LayerCosts, ModelProfile, measure_contention, profile_model
from pipeline.planner.link import Link, measure_allreduce, measure_link
from pipeline.planner.plan import Plan, PlanError, format_bytes, format_table, plan, plan_profile
from pipeline.planner.search import predict
from pipeline.planner.space import Candidate
from pipeline.planner.tensor import TensorSharding, sharding_of
from pipeline.planner.time_model import Sample, TimeModel, fit_time_model

__all__ = ["Candidate", "LayerCosts", "Link", "ModelProfile", "Plan", "PlanError", "Sample",
           "TensorSharding", "TimeModel", "fit_time_model", "format_bytes", "format_table",
           "measure_allreduce", "measure_contention", "measure_link", "plan", "plan_profile",
           "predict", "profile_model", "sharding_of"]
