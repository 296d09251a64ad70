"""Recovery plans the launcher publishes when workers die: rerouting, a dynamic layout, or a restart layout.

This is a small, self-contained planner for the runtime (the operator's search in `planner/search.py` is the
full one; any callable with the `Replanner` methods can replace this). Layers split evenly by measured time
inside each pipeline, micro-batches are balanced over pipelines with the exact 1F1B step time
(`planner.balance.balance_monotone` over `planner.estimator.pipeline_time`), and the restorer places the
layout on the survivors with the fewest bytes moved (`planner.restorer.place_plan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from resilientjob.planner._errors import PlannerError
from resilientjob.planner.balance import balance_monotone
from resilientjob.planner.estimator import pipeline_time
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.restorer import allreduce_rounds, place_plan, relabel


def _split_layers(profile: ModelProfile, stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges with about equal forward + backward time (greedy on prefix sums)."""
    layers = profile.num_layers
    stages = min(stages, layers)
    total = profile.prefix("forward") + profile.prefix("backward")
    bounds = [0]
    for index in range(1, stages):
        target = total[-1] * index / stages
        # Leave at least one layer for each remaining stage and take at least one for this one.
        low, high = bounds[-1] + 1, layers - (stages - index)
        best = min(range(low, high + 1), key=lambda cut: (abs(total[cut] - target), cut))
        bounds.append(best)
    bounds.append(layers)
    return [(bounds[i], bounds[i + 1]) for i in range(stages)]


def layout(profile: ModelProfile, nodes: int, replicas: int, microbatches: int, microbatch_size: int) -> Plan:
    """A DP x PP layout over `nodes` slot ids 0..nodes-1, replicas as deep as the nodes allow."""
    replicas = max(1, min(replicas, nodes, microbatches))
    sizes = [nodes // replicas + (1 if index < nodes % replicas else 0) for index in range(replicas)]
    splits = [_split_layers(profile, size) for size in sizes]
    times = []
    for split in splits:
        stage_times = [profile.stage_times(start, end) for start, end in split]
        times.append(([f for f, _ in stage_times], [b for _, b in stage_times]))
    counts = balance_monotone(lambda i, m: pipeline_time(times[i][0], times[i][1], m), replicas, microbatches)
    pipelines, slot = [], 0
    for split, count in zip(splits, counts, strict=True):
        stages = []
        for start, end in split:
            stages.append(StagePlan(layers=(start, end), node=slot))
            slot += 1
        pipelines.append(PipelinePlan(stages=tuple(stages), microbatches=count))
    step = max(pipeline_time(f, b, m) for (f, b), m in zip(times, counts, strict=True))
    return Plan(
        policy=Policy.DYNAMIC, microbatch_size=microbatch_size, pipelines=tuple(pipelines), step_time_s=step
    )


def total_microbatches(plan: Plan) -> int:
    return sum(pipeline.microbatches for pipeline in plan.pipelines)


@dataclass(frozen=True, slots=True)
class Replanner:
    """Turns (current plan, failed nodes) into the next plan."""

    profile: ModelProfile

    def reroute(self, plan: Plan, failed: frozenset[int]) -> Plan:
        """Each failed stage's micro-batches go to the live peers holding exactly its layers (ReCycle)."""
        alive_holdings = {
            node: layers for node, layers in plan.layers_by_node().items() if node not in failed
        }
        pipelines = []
        for index, pipeline in enumerate(plan.pipelines):
            stages = []
            for stage in pipeline.stages:
                if stage.node in failed or set(stage.rerouted_to) & failed:
                    wanted = set(range(*stage.layers))
                    peers = tuple(
                        sorted(
                            node
                            for node, layers in alive_holdings.items()
                            if wanted <= layers
                            and node != stage.node
                            and any(
                                s.node == node and s.layers == stage.layers
                                for p in plan.pipelines
                                for s in p.stages
                            )
                        )
                    )
                    if not peers:
                        raise PlannerError(
                            "failed", f"pipelines[{index}] layers {list(stage.layers)} have no live peer"
                        )
                    stages.append(stage.model_copy(update={"rerouted_to": peers}))
                else:
                    stages.append(stage)
            pipelines.append(PipelinePlan(stages=tuple(stages), microbatches=pipeline.microbatches))
        return plan.model_copy(
            update={
                "policy": Policy.REROUTE,
                "generation": plan.generation + 1,
                "pipelines": tuple(pipelines),
                "transfers": (),
                "allreduce_rounds": tuple(tuple(r) for r in allreduce_rounds(pipelines)),
                "failed_nodes": tuple(sorted(set(plan.failed_nodes) | failed)),
            }
        )

    def dynamic(self, plan: Plan, failed: frozenset[int], replicas: int | None = None) -> Plan:
        """A new layout over the live nodes, placed to move the fewest bytes; raises if a layer was lost."""
        holdings = {node: layers for node, layers in plan.layers_by_node().items() if node not in failed}
        if not holdings:
            raise PlannerError("failed", "no live node holds any layer")
        slot_plan = layout(
            self.profile,
            len(holdings),
            replicas or len(plan.pipelines),
            total_microbatches(plan),
            plan.microbatch_size,
        )
        placed, transfers = place_plan(slot_plan, holdings, self.profile)
        return placed.model_copy(
            update={
                "generation": plan.generation + 1,
                "transfers": tuple(transfers),
                "allreduce_rounds": tuple(tuple(r) for r in allreduce_rounds(placed.pipelines)),
                "failed_nodes": tuple(sorted(set(plan.failed_nodes) | failed)),
            }
        )

    def restart(self, plan: Plan, alive: Sequence[int], replicas: int | None = None) -> Plan:
        """Layout for a restart from checkpoint: nothing is copied, every worker loads its layers."""
        nodes = sorted(alive)
        slot_plan = layout(
            self.profile,
            len(nodes),
            replicas or len(plan.pipelines),
            total_microbatches(plan),
            plan.microbatch_size,
        )
        placed = relabel(slot_plan, [nodes[slot] for slot in range(len(nodes))])
        return placed.model_copy(
            update={
                "policy": Policy.CHECKPOINT,
                "generation": plan.generation + 1,
                "allreduce_rounds": tuple(tuple(r) for r in allreduce_rounds(placed.pipelines)),
                "failed_nodes": tuple(sorted(set(plan.failed_nodes) | (set(plan.nodes) - set(nodes)))),
            }
        )
