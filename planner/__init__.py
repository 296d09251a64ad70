"""resilientjob.planner: the pure core. Plans, profiles, estimators, templates, fail-slow algorithms and the
simulator. Imports numpy, scipy and pydantic only, so the operator, the agent and the simulator all call the
very same code."""

from .errors import PlannerError
from .estimator import (
    OneFOneB,
    allreduce_time,
    estimate_pipeline,
    pipeline_time,
    reroute_step_time,
    stage_peak_memory,
    symmetric_step_time,
)
from .plan import Candidate, PipelinePlan, Plan, Policy, StagePlan, Transfer
from .profile import LayerProfile, ModelProfile, builtin_profiles, uniform_profile
from .restorer import allreduce_rounds, match_slots, place_plan, transfer_list, transfer_time
from .search import initial_plan, replan
from .spec import ClusterSpec, JobSpec, TransitionCosts
from .template_recovery import reinstantiate
from .templates import PipelineTemplate, TemplateSet, generate_templates, instantiate

__all__ = [
    "Candidate",
    "ClusterSpec",
    "JobSpec",
    "LayerProfile",
    "ModelProfile",
    "OneFOneB",
    "PipelinePlan",
    "PipelineTemplate",
    "Plan",
    "PlannerError",
    "Policy",
    "StagePlan",
    "TemplateSet",
    "Transfer",
    "TransitionCosts",
    "allreduce_rounds",
    "allreduce_time",
    "builtin_profiles",
    "estimate_pipeline",
    "generate_templates",
    "initial_plan",
    "instantiate",
    "match_slots",
    "pipeline_time",
    "place_plan",
    "reinstantiate",
    "replan",
    "reroute_step_time",
    "stage_peak_memory",
    "symmetric_step_time",
    "transfer_list",
    "transfer_time",
    "uniform_profile",
]
