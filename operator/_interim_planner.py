"""Interim stand-in for `resilientjob.planner.search` used only while that module has not landed: a plain
symmetric DP x PP layout over the alive nodes. `_planning.py` prefers the real module when importable."""

from __future__ import annotations

from collections.abc import Collection

from resilientjob.planner._errors import PlannerError
from resilientjob.planner.estimator import estimate_pipeline
from resilientjob.planner.plan import Candidate, PipelinePlan, Plan, Policy, StagePlan
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.spec import ClusterSpec, JobSpec, TransitionCosts


def _layout(
    profile: ModelProfile, cluster: ClusterSpec, job: JobSpec, alive: list[int], policy: Policy
) -> Plan:
    count = len(alive)
    for pp in [2, 1, *range(3, count + 1)]:
        if count % pp or pp > profile.num_layers or job.num_microbatches < count // pp:
            continue
        dp = count // pp
        bounds = [round(i * profile.num_layers / pp) for i in range(pp + 1)]
        share = [job.num_microbatches // dp + (i < job.num_microbatches % dp) for i in range(dp)]
        pipelines = tuple(
            PipelinePlan(
                stages=tuple(
                    StagePlan(layers=(bounds[s], bounds[s + 1]), node=alive[r * pp + s]) for s in range(pp)
                ),
                microbatches=share[r],
            )
            for r in range(dp)
        )
        step = max(estimate_pipeline(profile, cluster, pipe) for pipe in pipelines)
        plan = Plan(policy=policy, microbatch_size=job.microbatch_size, pipelines=pipelines, step_time_s=step)
        cand = Candidate(
            policy=policy, layout=plan.layout, step_time_s=step, transition_s=0.0, score=plan.throughput
        )
        return plan.model_copy(update={"candidates": (cand,)})
    raise PlannerError("nodes", f"no symmetric layout fits {count} alive nodes")


def initial_plan(
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
    *,
    policy: Policy = Policy.AUTO,
    costs: TransitionCosts | None = None,
) -> Plan:
    return _layout(profile, cluster, job, list(range(cluster.nodes)), Policy.DYNAMIC)


def replan(
    current: Plan,
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
    *,
    failed: Collection[int] = (),
    joined: Collection[int] = (),
    policy: Policy = Policy.AUTO,
    costs: TransitionCosts | None = None,
    failure_rate_per_node_hour: float = 0.01,
) -> Plan:
    dead = (set(current.failed_nodes) | set(failed)) - set(joined)
    alive = [n for n in range(cluster.nodes) if n not in dead]
    plan = _layout(profile, cluster, job, alive, Policy.DYNAMIC)
    return plan.model_copy(update={"generation": current.generation + 1, "failed_nodes": tuple(sorted(dead))})
