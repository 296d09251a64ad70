"""The harness's side of planning: the planner's search (`planner.search`) with what the local runtime knows.

Every decision (the initial layout, reroute vs dynamic vs templates vs checkpoint, layer splits, micro-batch
shares, placement and transfers) is `planner.search.initial_plan` / `replan`, exactly as the operator calls
it; this module only supplies what the runtime owns: the model's `ModelProfile` (measured by
`profiler.measure_profile`, or nominal times with exact bytes), the job's batch and fault tolerance, and
transition costs that match this runtime (a live switch costs a rendezvous, not a pod restart).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from resilientjob.planner.plan import Plan, Policy
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.search import initial_plan, prepare_templates, replan
from resilientjob.planner.spec import ClusterSpec, JobSpec, TransitionCosts

LOCAL_COSTS = TransitionCosts(
    restart_s=0.3,  # live switch measured by bench/bench_recovery.py: rendezvous + copy + resume
    checkpoint_load_s=8.0,  # restart path: start fresh worker processes, import torch, load DCP
    detection_s=0.1,  # process exit -> launcher notices (20 ms polling) and announces it
    checkpoint_interval_s=60.0,
)
"""Transition costs of this runtime on one machine; the operator passes its cluster's own."""


@dataclass(frozen=True, slots=True)
class RuntimePlanner:
    """`planner.search` bound to one job: the plans the launcher publishes."""

    profile: ModelProfile
    cluster: ClusterSpec
    job: JobSpec
    costs: TransitionCosts = field(default=LOCAL_COSTS)
    failure_rate_per_node_hour: float = 0.01

    def __post_init__(self) -> None:
        if self.failure_rate_per_node_hour < 0:
            raise ValueError(
                f"failure_rate_per_node_hour: must be >= 0, got {self.failure_rate_per_node_hour}"
            )

    @classmethod
    def for_job(
        cls,
        profile: ModelProfile,
        nodes: int,
        global_batch: int,
        microbatch_size: int,
        fault_tolerance: int = 1,
        dp_range: tuple[int, int] | None = None,
        pp_range: tuple[int, int] | None = None,
        bandwidth: float = 1e9,
        costs: TransitionCosts = LOCAL_COSTS,
        failure_rate_per_node_hour: float = 0.01,
        message_latency_s: float = 0.0,
        gpus_per_node: int = 1,
    ) -> RuntimePlanner:
        """`gpus_per_node` workers (devices) per node: with more than one, stages are tensor-parallel over
        the node's devices; bandwidth (bytes/s) is loopback-like; `message_latency_s` as
        `profiler.measure_message_latency` measures it (0: bandwidth only)."""
        cluster = ClusterSpec(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            inter_node_bandwidth=bandwidth,
            message_latency_s=message_latency_s,
        )
        job = JobSpec(
            global_batch=global_batch,
            microbatch_size=microbatch_size,
            fault_tolerance=fault_tolerance,
            dp_range=dp_range,
            pp_range=pp_range,
        )
        return cls(profile, cluster, job, costs, failure_rate_per_node_hour)

    def initial(self, policy: Policy = Policy.AUTO) -> Plan:
        """Generation 0 over every node; `auto` also prepares the pipeline templates (as Oobleck does)."""
        plan = initial_plan(self.profile, self.cluster, self.job, policy=policy, costs=self.costs)
        if policy is Policy.AUTO:
            prepare_templates(self.profile, self.cluster, self.job)
        return plan

    def recover(self, current: Plan, failed: Collection[int], policy: Policy = Policy.AUTO) -> Plan:
        """The next plan after `failed` (new failures only) stopped; the planner may choose checkpoint."""
        return replan(
            current,
            self.profile,
            self.cluster,
            self.job,
            failed=failed,
            policy=policy,
            costs=self.costs,
            failure_rate_per_node_hour=self.failure_rate_per_node_hour,
        )

    def grow(self, current: Plan, joined: Collection[int], policy: Policy = Policy.AUTO) -> Plan:
        """The next plan once new nodes (replacements under new ids) run: the planner's scale-up choice."""
        return replan(
            current,
            self.profile,
            self.cluster,
            self.job,
            joined=joined,
            policy=policy,
            costs=self.costs,
            failure_rate_per_node_hour=self.failure_rate_per_node_hour,
        )

    def upgrade(self, current: Plan) -> Plan:
        """A dynamic layout over the live nodes, e.g. to leave a rerouted plan once the job is stable."""
        return self.recover(current, (), Policy.DYNAMIC)

    def restart(self, current: Plan, failed: Collection[int]) -> Plan:
        """The layout a checkpoint restart runs on (nothing is copied; every worker loads its layers)."""
        return self.recover(current, failed, Policy.CHECKPOINT)
