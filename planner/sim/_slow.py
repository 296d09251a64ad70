"""Step time of a plan while some nodes or links run slow, with and without Falcon's S2 and S3.

The plan's own `step_time_s` (the planner's estimate) stays the reference: a slow node changes the step by
the difference between the slowed and the healthy 1F1B makespans (`estimator.pipeline_time`, the same
simulation the planner estimates with), plus the slowed share of the gradient all-reduce
(`estimator.allreduce_time`). With nothing slow the result is exactly `plan.step_time_s`.

- Compute fail-slow with factor f on node n: n's stages take f times longer per micro-batch.
- Link fail-slow with factor f at node n's NIC: the data-parallel all-reduce ring through n runs f times
  slower, and so do n's pipeline sends. After S3 (topology adjustment, Falcon Fig. 10) the congested link
  carries pipeline traffic only, so only the sends stay slow.
- S2 (micro-batch redistribution) re-splits the pipelines' micro-batches with `balance.balance_monotone`
  over exact 1F1B makespans: the exact form of Falcon's eq. 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..balance import balance_monotone
from ..estimator import allreduce_time, pipeline_arrays, pipeline_time
from ..plan import PipelinePlan, Plan
from ..profile import ModelProfile
from ..restorer import allreduce_rounds
from ..spec import ClusterSpec


@dataclass(frozen=True, slots=True)
class SlowState:
    """Slow-down factors in force: per node for compute, per node's NIC for links; mitigations applied."""

    compute: Mapping[int, float]
    link: Mapping[int, float]
    rebalanced: bool = False  # S2 applied
    link_moved: bool = False  # S3 applied: slow links carry pipeline traffic only

    @property
    def healthy(self) -> bool:
        return not self.compute and not self.link


def _pipeline_makespan(
    profile: ModelProfile,
    cluster: ClusterSpec,
    pipeline: PipelinePlan,
    microbatches: int,
    compute: Mapping[int, float],
    link: Mapping[int, float],
) -> float:
    forward, backward, sends = pipeline_arrays(profile, cluster, pipeline, compute, link)
    return pipeline_time(forward, backward, microbatches, sends)


def _slowest(
    profile: ModelProfile,
    cluster: ClusterSpec,
    pipelines: Sequence[PipelinePlan],
    counts: Sequence[int],
    compute: Mapping[int, float],
    link: Mapping[int, float],
) -> float:
    return max(
        _pipeline_makespan(profile, cluster, pipeline, count, compute, link)
        for pipeline, count in zip(pipelines, counts, strict=True)
    )


def rebalanced_microbatches(
    profile: ModelProfile,
    cluster: ClusterSpec,
    plan: Plan,
    compute: Mapping[int, float],
    link: Mapping[int, float],
) -> list[int]:
    """Falcon S2: micro-batches per pipeline minimising the slowest pipeline under the current slowness."""
    pipelines = plan.pipelines
    total = sum(pipeline.microbatches for pipeline in pipelines)

    cache: dict[tuple[int, int], float] = {}

    def cost(index: int, count: int) -> float:
        key = (index, count)
        if key not in cache:
            cache[key] = _pipeline_makespan(profile, cluster, pipelines[index], count, compute, link)
        return cache[key]

    return balance_monotone(cost, len(pipelines), total, minimum=1)


def slowed_step_time(profile: ModelProfile, cluster: ClusterSpec, plan: Plan, state: SlowState) -> float:
    """The plan's step time under `state` (exactly `plan.step_time_s` when nothing is slow)."""
    if state.healthy:
        return plan.step_time_s
    pipelines = plan.pipelines
    healthy_counts = [pipeline.microbatches for pipeline in pipelines]
    healthy = _slowest(profile, cluster, pipelines, healthy_counts, {}, {})
    send_links = state.link
    counts = (
        rebalanced_microbatches(profile, cluster, plan, state.compute, send_links)
        if state.rebalanced
        else healthy_counts
    )
    slowed = _slowest(profile, cluster, pipelines, counts, state.compute, send_links)
    extra_sync = 0.0
    if state.link and not state.link_moved and len(pipelines) > 1:
        used = set(plan.nodes)
        factor = max((f for node, f in state.link.items() if node in used), default=1.0)
        if factor > 1.0:
            rounds = plan.allreduce_rounds or tuple(tuple(r) for r in allreduce_rounds(pipelines))
            extra_sync = allreduce_time(profile, cluster, rounds, len(pipelines)) * (factor - 1.0)
    return max(plan.step_time_s + slowed - healthy + extra_sync, 0.0)
