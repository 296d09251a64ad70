"""A tiny planner used only by the simulator's tests: it proves the simulator calls whatever planner it is
given (not a copy of the real one) and gives hand-checkable numbers. Production code uses `planner.search`."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile, PlannerError
from resilientjob.planner.estimator import estimate_pipeline
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.planner.sim import Planner
from resilientjob.planner.spec import TransitionCosts

STUB_PLANNING_S = 0.25
DEFAULT_COSTS = TransitionCosts()


@dataclass
class StubPlanner:
    """Symmetric DP x PP2 plans over the alive nodes; records every call."""

    calls: list[tuple[str, tuple[int, ...], tuple[int, ...], Policy]] = field(default_factory=list)

    def build(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        job: JobSpec,
        alive: list[int],
        policy: Policy,
        gen: int,
    ) -> Plan:
        pp = 2 if len(alive) >= 2 else 1
        dp = len(alive) // pp
        if dp < 1:
            raise PlannerError("nodes", "no node left")
        total = job.num_microbatches
        if total < dp:
            raise PlannerError("global_batch", "fewer micro-batches than pipelines")
        half = profile.num_layers // pp
        bounds = [(0, half), (half, profile.num_layers)] if pp == 2 else [(0, profile.num_layers)]
        pipelines = []
        for index in range(dp):
            stages = tuple(StagePlan(layers=bounds[s], node=alive[index * pp + s]) for s in range(pp))
            share = total // dp + (1 if index < total % dp else 0)
            pipelines.append(PipelinePlan(stages=stages, microbatches=share))
        step = max(estimate_pipeline(profile, cluster, p) for p in pipelines)
        concrete = Policy.DYNAMIC if policy is Policy.AUTO else policy
        failed = tuple(n for n in range(cluster.nodes) if n not in alive)
        return Plan(
            policy=concrete,
            generation=gen,
            microbatch_size=job.microbatch_size,
            pipelines=tuple(pipelines),
            step_time_s=step,
            failed_nodes=failed,
            planning_s=STUB_PLANNING_S,
        )

    def initial_plan(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        job: JobSpec,
        *,
        policy: Policy = Policy.AUTO,
        costs: TransitionCosts = DEFAULT_COSTS,
    ) -> Plan:
        self.calls.append(("initial", (), (), policy))
        return self.build(profile, cluster, job, list(range(cluster.nodes)), policy, 0)

    def replan(
        self,
        current: Plan,
        profile: ModelProfile,
        cluster: ClusterSpec,
        job: JobSpec,
        *,
        failed: Collection[int] = (),
        joined: Collection[int] = (),
        policy: Policy = Policy.AUTO,
        costs: TransitionCosts = DEFAULT_COSTS,
        failure_rate_per_node_hour: float = 0.01,
    ) -> Plan:
        self.calls.append(("replan", tuple(failed), tuple(joined), policy))
        down = (set(current.failed_nodes) | set(failed)) - set(joined)
        alive = [n for n in range(cluster.nodes) if n not in down]
        return self.build(profile, cluster, job, alive, policy, current.generation + 1)

    def as_planner(self) -> Planner:
        return Planner(initial_plan=self.initial_plan, replan=self.replan)
