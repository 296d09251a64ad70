"""Pipeline reinstantiation after failures (Oobleck section 5.1, appendix B), behind `planner.templates`.

Pipelines that lost no node keep their nodes, stages and GPUs. Each affected pipeline is rebuilt from the
template of its surviving size (simple reinstantiation); one left with fewer than n0 nodes first takes
joined nodes, then borrows nodes from pipelines that can spare one (largest first; the lender is rebuilt one
size smaller), and only when nobody can lend is it merged with another pipeline. Within a rebuilt pipeline
the surviving nodes take the template's node slots by min-cost matching on the layers they already hold, so
only missing layers travel; transfers come from the current plan's holdings. Micro-batches are rebalanced
over all pipelines so the global batch is unchanged.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Sequence

from ._time_curve import TimeCurve, balance_curves
from .errors import PlannerError
from .estimator import allreduce_time, pipeline_arrays, stage_peak_memory
from .plan import PipelinePlan, Plan, Policy
from .profile import ModelProfile
from .restorer import allreduce_rounds, match_slots, place_plan, transfer_list
from .spec import ClusterSpec, JobSpec
from .templates import TemplateSet, instantiate, pipeline_plan


class _Group:
    """The nodes one new pipeline will use; `kept` is the old pipeline when it survives untouched."""

    def __init__(self, nodes: list[int], kept: PipelinePlan | None) -> None:
        self.nodes = nodes
        self.kept = kept

    def take(self) -> int:
        self.kept = None
        return self.nodes.pop()

    def give(self, extra: Sequence[int]) -> None:
        self.kept = None
        self.nodes.extend(extra)


def _check_nodes(current: Plan, failed: set[int], joined: set[int]) -> None:
    known = set(current.nodes)
    unknown = sorted(failed - known)
    if unknown:
        raise PlannerError("failed", f"node(s) {unknown} are not in the current plan")
    clash = sorted(joined & (known - failed))
    if clash:
        raise PlannerError("joined", f"node(s) {clash} already run a stage")
    if any(node < 0 for node in joined):
        raise PlannerError("joined", "node ids must be non-negative")


def _regroup(
    templates: TemplateSet, current: Plan, failed: set[int], joined: list[int], emptied: set[int]
) -> list[_Group]:
    n0, largest = templates.n0, templates.sizes[-1]
    groups: list[_Group] = []
    for pipeline in current.pipelines:
        alive = [node for node in pipeline.nodes if node not in failed]
        # A pipeline with an emptied node is rebuilt: its layers must be copied there again.
        untouched = len(alive) == len(pipeline.nodes) and not emptied & set(pipeline.nodes)
        if alive:
            groups.append(_Group(alive, pipeline if untouched else None))
    pool = list(joined)
    # Pipelines below n0: joined nodes first, then borrowing, then merging.
    while True:
        small = sorted((g for g in groups if len(g.nodes) < n0), key=lambda g: len(g.nodes))
        if not small:
            break
        group = small[0]
        if pool:
            group.give([pool.pop(0)])
            continue
        lenders = [g for g in groups if g is not group and len(g.nodes) > n0]
        if lenders:
            lender = max(lenders, key=lambda g: (len(g.nodes), -groups.index(g)))
            group.give([lender.take()])
            continue
        # Nobody can lend: merge with another small pipeline, else with the smallest one (appendix B).
        others = [g for g in groups if g is not group]
        if not others:
            raise PlannerError("failed", "one pipeline is left with fewer than n0 nodes")
        partner = min(others, key=lambda g: (len(g.nodes) >= n0, len(g.nodes)))
        partner.give(group.nodes)
        groups.remove(group)
        if len(partner.nodes) > largest:
            pool.extend(partner.nodes[largest:])
            del partner.nodes[largest:]
    # Leftover joined nodes: new pipelines when they make one, else they join the smallest pipelines.
    while pool:
        if len(pool) >= n0:
            size = min(len(pool), largest)
            groups.append(_Group(pool[:size], None))
            del pool[:size]
            continue
        growable = [g for g in groups if len(g.nodes) < largest]
        if growable:
            min(growable, key=lambda g: len(g.nodes)).give([pool.pop(0)])
            continue
        # Every pipeline is at the largest size: split one into two that both reach n0; when no pipeline
        # and the pool make two, the pool's nodes stay idle (the job keeps its layout).
        donors = [g for g in groups if len(g.nodes) + len(pool) >= 2 * n0]
        if not donors:
            break
        donor = max(donors, key=lambda g: (len(g.nodes), -groups.index(g)))
        donor.give(pool)
        pool = []
        groups.append(_Group(donor.nodes[-n0:], None))
        del donor.nodes[-n0:]
    return groups


def _layout(
    templates: TemplateSet,
    group: _Group,
    holdings: dict[int, set[int]],
    profile: ModelProfile,
) -> PipelinePlan:
    if group.kept is not None:
        return group.kept
    template = templates.for_nodes(len(group.nodes))
    slots: list[set[int]] = [set() for _ in range(template.nodes)]
    for stage in template.stages:
        slots[stage.node].update(range(*stage.layers))
    local = {node: holdings.get(node, set()) for node in group.nodes}
    order = match_slots(local, slots, profile)
    return pipeline_plan(profile, template, order, 1)


def _signature(pipeline: PipelinePlan) -> tuple[object, ...]:
    stages = pipeline.stages
    shape = tuple((stage.layers, len(stage.gpus)) for stage in stages)
    hops = tuple(a.node == b.node for a, b in itertools.pairwise(stages))
    return shape, hops


def balanced_plan(
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
    pipelines: Sequence[PipelinePlan],
) -> Plan:
    """Plan over fixed pipeline layouts: micro-batches balanced exactly on their 1F1B times."""
    total = job.num_microbatches
    if total < len(pipelines):
        raise PlannerError(
            "global_batch",
            f"{total} micro-batches cannot feed {len(pipelines)} pipelines; the nearest global batch that "
            f"can be split is {len(pipelines) * job.microbatch_size}",
        )
    # One time curve per distinct pipeline shape (`_time_curve`): pipelines rebuilt from the same
    # template share it, and the split is a search over the tables rather than a simulation per unit.
    limit = total - len(pipelines) + 1
    shapes: dict[tuple[object, ...], int] = {}
    tables: list[TimeCurve] = []
    group_of: list[int] = []
    for pipeline in pipelines:
        key = _signature(pipeline)
        if key not in shapes:
            shapes[key] = len(tables)
            forward, backward, sends = pipeline_arrays(profile, cluster, pipeline)
            tables.append(TimeCurve.of_pipeline(forward, backward, sends, limit))
        group_of.append(shapes[key])
    copies = [group_of.count(group) for group in range(len(tables))]
    _, grouped = balance_curves(tables, copies, total)
    queues: list[list[int]] = []
    offset = 0
    for many in copies:
        queues.append(grouped[offset : offset + many])
        offset += many
    counts = [queues[group].pop(0) for group in group_of]

    def cost(index: int, count: int) -> float:
        return tables[group_of[index]].at(count)

    plans = tuple(
        pipeline_plan_with(pipeline, count, profile)
        for pipeline, count in zip(pipelines, counts, strict=True)
    )
    rounds = allreduce_rounds(plans)
    compute = max(cost(index, count) for index, count in enumerate(counts))
    return Plan(
        policy=Policy.TEMPLATES,
        microbatch_size=job.microbatch_size,
        pipelines=plans,
        step_time_s=compute + allreduce_time(profile, cluster, rounds, len(plans)),
        allreduce_rounds=tuple(tuple(segments) for segments in rounds),
    )


def pipeline_plan_with(pipeline: PipelinePlan, microbatches: int, profile: ModelProfile) -> PipelinePlan:
    """The same stages with a new micro-batch count and the peak memory that count implies."""
    count = len(pipeline.stages)
    stages = tuple(
        stage.model_copy(
            update={
                "peak_memory_bytes": stage_peak_memory(
                    profile, stage.layers[0], stage.layers[1], len(stage.gpus), index, count, microbatches
                )
            }
        )
        for index, stage in enumerate(pipeline.stages)
    )
    return pipeline.model_copy(update={"stages": stages, "microbatches": microbatches})


def reinstantiate(
    templates: TemplateSet,
    current: Plan,
    failed: Collection[int],
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
    joined: Collection[int] = (),
    emptied: Collection[int] = (),
) -> Plan:
    """The plan after `failed` nodes leave (and `joined` nodes arrive), changing as little as possible.
    `emptied`: surviving nodes whose layers are not to be trusted (`search.replan`): they hold nothing, are
    no copy's source, and their pipelines are rebuilt."""
    began = time.perf_counter()
    failed_set, joined_list = set(failed), sorted(set(joined))
    _check_nodes(current, failed_set, set(joined_list))
    alive = [node for node in current.nodes if node not in failed_set] + joined_list
    minimum = templates.fault_tolerance + 1
    if len(alive) < minimum * templates.n0:
        raise PlannerError(
            "failed",
            f"{len(alive)} nodes remain; {minimum} pipelines of at least {templates.n0} nodes need "
            f"{minimum * templates.n0}: restart from a checkpoint",
        )
    emptied_set = set(emptied) - failed_set
    holdings = {
        node: set() if node in emptied_set else layers
        for node, layers in current.layers_by_node().items()
        if node not in failed_set
    }
    holdings.update({node: set() for node in joined_list})
    groups = _regroup(templates, current, failed_set, joined_list, emptied_set)
    if len(groups) >= minimum:
        pipelines = [_layout(templates, group, holdings, profile) for group in groups]
        plan = balanced_plan(profile, cluster, job, pipelines)
        transfers = transfer_list(holdings, plan.layers_by_node(), profile)
    else:
        # Merging left fewer than f + 1 pipelines: instantiate afresh, placed to move the fewest bytes.
        fresh = instantiate(templates, list(range(len(alive))), profile, cluster, job)
        plan, transfers = place_plan(fresh, holdings, profile)
    failed_nodes = (set(current.failed_nodes) | failed_set) - set(joined_list)
    return plan.model_copy(
        update={
            "generation": current.generation + 1,
            "transfers": tuple(transfers),
            "failed_nodes": tuple(sorted(failed_nodes)),
            "planning_s": time.perf_counter() - began,
        }
    )
