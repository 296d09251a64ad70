"""The plans of Falcon's mitigations for a running job (S2, S3 a and b, restore), pure: no I/O.

- S2 (`microbatch_plan`): the pipelines keep their stages; micro-batches move off the pipelines through slow
  nodes (`balance.balance_monotone` over the exact 1F1B makespans with the slow stages slowed), all of them
  where that is fastest (`drain_floors`), cut into smaller micro-batches when whole ones are too coarse to
  balance and the job allows it (`spec.failSlow.microBatchSplit`, `FINER_GAIN`);
- S3 a (`link_plan`): the pipelines are reordered and nodes swapped so that fewer bytes cross the slow links
  (`failslow.reroute_slow_links`, Falcon Fig. 10; any layout);
- S3 b (`topology_plan`): stragglers are consolidated into as few stages as possible
  (`failslow.consolidate_stragglers`, Fig. 11);
- `restored_plan`: the healthy plan from before the episode, when it is estimated faster.

Each returns the next generation's plan (weights copied peer-to-peer as listed in its transfers), or a
sentence saying why nothing would help.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from resilientjob.planner.balance import balance_monotone
from resilientjob.planner.errors import PlannerError
from resilientjob.planner.estimator import pipeline_arrays, pipeline_time
from resilientjob.planner.failslow import NodeGrid, consolidate_stragglers, reroute_slow_links
from resilientjob.planner.plan import PipelinePlan, Plan
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.restorer import transfer_list
from resilientjob.planner.spec import ClusterSpec

FINER_GAIN = 0.1
"""S2 cuts micro-batches smaller than the job's own only when that split is estimated this much faster
than the best one of whole micro-batches: the estimate scales a micro-batch's time with its samples, and a
smaller micro-batch's fixed costs (kernel launches, per-message latency) do not shrink."""


DRAIN_MARGIN = 0.15
"""How much dearer S2 prices the micro-batches it would leave a slow node when it weighs draining that
node's replica instead: the part of the estimate it knows least. The estimate scales the slow node's step
with its micro-batches, but the step's fixed work (the optimizer, the gradient sync's compute) is slowed
too and does not shrink with them, and a slowdown measured on a busy host reads low (the demo's x4 worker
read 2.0-3.3x). In the demo a kept micro-batch, estimated 1% and 11% faster than draining, ran the job at
1.34x and 1.52x healthy where drained runs ran at 1.10-1.26x. A mildly slow node whose kept micro-batches
stay well inside the step (x1.5 with one of two) is kept: the margin changes nothing there."""


def _pipeline_time(
    profile: ModelProfile,
    cluster: ClusterSpec,
    pipeline: PipelinePlan,
    microbatches: int,
    factors: dict[int, float],
) -> float:
    """Exact 1F1B makespan of one pipeline with the stages on slow nodes slowed by their factor (`profile`
    already at the plan's micro-batch size)."""
    forward, backward, sends = pipeline_arrays(profile, cluster, pipeline, compute=factors)
    return pipeline_time(forward, backward, microbatches, sends)


def slowed_step_time(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, factors: dict[int, float]
) -> float:
    """The plan's pipeline makespan (no gradient sync) with slow nodes slowed: the quantity S2 and S3
    minimise, and, with no factors, the healthy estimate a restore compares."""
    sized = profile.at_microbatch(plan.microbatch_size)
    return max(
        _pipeline_time(sized, cluster, pipeline, pipeline.microbatches, factors)
        for pipeline in plan.pipelines
    )


def microbatch_sizes(plan: Plan, profile: ModelProfile, split: int = 1) -> list[int]:
    """The micro-batch sizes S2 may give `plan`, the largest first: the divisors of the job's own size (the
    profile's) down to a `split`th of it (never under one sample). Only the plan's size when the profile's
    is unknown."""
    base = profile.microbatch_size
    if base is None or split < 2:
        return [base or plan.microbatch_size]
    smallest = -(-base // split)  # a micro-batch cut into at most `split` parts
    return [size for size in range(base, smallest - 1, -1) if base % size == 0]


def sync_time(healthy: Plan, profile: ModelProfile, cluster: ClusterSpec) -> float:
    """What the planner's step estimate adds to the pipeline makespan (gradient sync), from the healthy
    plan: a mitigated plan's published estimate is its slowed makespan plus this."""
    return max(0.0, healthy.step_time_s - slowed_step_time(healthy, profile, cluster, {}))


def microbatch_plan(
    plan: Plan,
    profile: ModelProfile,
    cluster: ClusterSpec,
    factors: dict[int, float],
    sync_s: float,
    split: int = 1,
) -> Plan | str:
    """S2: the same stages with micro-batches re-split to minimise the slowed makespan; or why not. Whole
    micro-batches of the job's size first; where the job allows (`split` > 1) smaller ones
    (`microbatch_sizes`) when they are estimated `FINER_GAIN` faster still: with two micro-batches per
    replica a 1.5x slow replica can give away none (one would leave a healthy replica with three), with
    eight quarter-size ones it can give away two."""
    if len(plan.pipelines) < 2:
        return "one pipeline only: there is no other pipeline to take micro-batches"
    samples = plan.global_batch
    sizes = [size for size in microbatch_sizes(plan, profile, split) if samples % size == 0]
    if not sizes:  # the profile's size does not divide the plan's batch: keep the plan's own size
        sizes = [plan.microbatch_size]
    before = slowed_step_time(plan, profile, cluster, factors)
    splits = {
        size: _best_split(plan, profile.at_microbatch(size), cluster, factors, samples // size, before)
        for size in sizes
    }
    # The fastest split, the larger micro-batches on a tie; a finer one only if it beats the job's own size
    # by the margin its unmodelled fixed costs ask.
    size = min(sizes, key=lambda size: (splits[size][0], -size))
    if size != sizes[0] and not splits[size][0] < splits[sizes[0]][0] * (1 - FINER_GAIN):
        size = sizes[0]
    after, counts = splits[size]
    if size == plan.microbatch_size and tuple(counts) == tuple(p.microbatches for p in plan.pipelines):
        return "the current split is already the best for these slowdowns"
    pipelines = tuple(
        pipeline.model_copy(update={"microbatches": count})
        for pipeline, count in zip(plan.pipelines, counts, strict=True)
    )
    if after >= before * (1 - 1e-9):
        return "no split is faster than the current one"
    return plan.model_copy(
        update={
            "generation": plan.generation + 1,
            "microbatch_size": size,
            "pipelines": pipelines,
            "step_time_s": after + sync_s,
            "transfers": (),
            "transition_s": 0.0,
            "candidates": (),
        }
    )


def _best_split(
    plan: Plan,
    sized: ModelProfile,
    cluster: ClusterSpec,
    factors: dict[int, float],
    total: int,
    now_s: float,
) -> tuple[float, list[int]]:
    """The slowed makespan and micro-batch counts per pipeline of the best split of `total` micro-batches
    (of the size `sized` is for) over `plan`'s pipelines, with the slow nodes' pipelines drained where
    `drain_slow_pipelines` allows (`now_s`: the plan's slowed makespan now, which a drain must still beat)."""
    cache: dict[tuple[int, int], float] = {}

    def cost(index: int, count: int) -> float:
        key = (index, count)
        if key not in cache:
            cache[key] = _pipeline_time(sized, cluster, plan.pipelines[index], count, factors)
        return cache[key]

    floors = drain_floors(plan, factors)
    counts = balance_monotone(cost, len(plan.pipelines), total, floors)
    best = max(cost(index, count) for index, count in enumerate(counts))
    # Would keeping the slow pipelines still win with their micro-batches priced DRAIN_MARGIN dearer? Ties
    # always drain; a drain must still beat the plan now.
    wary = max(
        cost(index, count) * (1 + DRAIN_MARGIN if floors[index] == 0 and count else 1)
        for index, count in enumerate(counts)
    )
    bound = max(best * (1 + 1e-9), min(wary, now_s * (1 - 1e-9)))
    counts = drain_slow_pipelines(counts, floors, cost, bound)
    return max(cost(index, count) for index, count in enumerate(counts)), counts


def drain_slow_pipelines(
    counts: list[int], floors: list[int], cost: Callable[[int, int], float], bound: float
) -> list[int]:
    """`counts` with each pipeline through slow nodes (floor 0) drained, all its micro-batches moved to the
    others, where no pipeline then takes longer than `bound` (the split's makespan with the slow pipelines
    priced `DRAIN_MARGIN` dearer). A drained node cannot set the job's pace whatever it really costs. All
    or nothing: a slow node left with less work still gates the step."""
    counts = list(counts)
    healthy = [index for index, floor in enumerate(floors) if floor > 0]
    for index in (index for index, floor in enumerate(floors) if floor == 0):
        moved = list(counts)
        while moved[index] > 0 and healthy:
            target = min(healthy, key=lambda other: (cost(other, moved[other] + 1), other))
            if cost(target, moved[target] + 1) > bound:
                break
            moved[index] -= 1
            moved[target] += 1
        if moved[index] == 0:
            counts = moved
    return counts


def drain_floors(plan: Plan, factors: dict[int, float]) -> list[int]:
    """The fewest micro-batches S2 leaves each pipeline: none for one through a slow node, one for the others.

    Falcon's S2 keeps every replica at one micro-batch or more (its eq. 1, m_i in N+). A replica whose one
    micro-batch alone takes longer than the others' whole step then sets the job's pace however the rest are
    split: x4 with two micro-batches per replica keeps the step at 2x healthy. Drained, it runs no
    micro-batch, keeps its weights current through the gradient sum (so the restore copies nothing) and
    probes its device for the recovery. Healthy pipelines keep one: draining them would win nothing the
    estimate can see and leave nodes idle that nothing slows."""
    slow = {node for node, factor in factors.items() if factor > 1.0}
    return [0 if slow & set(pipeline.nodes) else 1 for pipeline in plan.pipelines]


def _grid(plan: Plan) -> NodeGrid | str:
    bounds = {tuple(stage.layers for stage in pipeline.stages) for pipeline in plan.pipelines}
    if len(bounds) != 1:
        return "the layout is asymmetric; consolidating stragglers needs equal pipelines"
    if any(stage.rerouted for pipeline in plan.pipelines for stage in pipeline.stages):
        return "the layout reroutes failed stages"
    rows = tuple(tuple(stage.node for stage in pipeline.stages) for pipeline in plan.pipelines)
    try:
        return NodeGrid(rows, next(iter(bounds)))
    except PlannerError as exc:
        return exc.message


def _regridded(plan: Plan, rows: tuple[tuple[int, ...], ...]) -> Plan:
    """`plan` with the nodes of its (symmetric) stages replaced row by row."""
    pipelines = tuple(
        pipeline.model_copy(
            update={
                "stages": tuple(
                    stage.model_copy(update={"node": node})
                    for stage, node in zip(pipeline.stages, row, strict=True)
                )
            }
        )
        for pipeline, row in zip(plan.pipelines, rows, strict=True)
    )
    return plan.model_copy(update={"pipelines": pipelines})


def topology_plan(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, factors: dict[int, float], sync_s: float
) -> Plan | str:
    """S3 b: stragglers packed into as few (interior) stages as possible, weights copied peer-to-peer."""
    grid = _grid(plan)
    if isinstance(grid, str):
        return grid
    stragglers = [node for node in factors if node in set(grid.nodes)]
    change = consolidate_stragglers(grid, stragglers, profile.at_microbatch(plan.microbatch_size))
    if not change.moved:
        return "the stragglers already sit in as few stages as they can"
    moved = _regridded(plan, change.after.rows)
    before = slowed_step_time(plan, profile, cluster, factors)
    after = slowed_step_time(moved, profile, cluster, factors)
    if after >= before * (1 - 1e-9):
        return "moving the stragglers would not shorten the step"
    return moved.model_copy(
        update={
            "generation": plan.generation + 1,
            "step_time_s": after + sync_s,
            "transfers": change.transfers,
            "transition_s": 0.0,
            "candidates": (),
        }
    )


def link_plan(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, links: Sequence[tuple[int, int]], sync_s: float
) -> Plan | str:
    """S3 a: pipelines reordered and nodes swapped so that fewer bytes cross the slow links (node pairs):
    the gradient rings' hops off them first, pipeline sends where they weigh less; free moves preferred."""
    if any(stage.rerouted for pipeline in plan.pipelines for stage in pipeline.stages):
        return "the layout reroutes failed stages"
    inside = set(plan.nodes)
    congested = [(a, b) for a, b in links if a in inside and b in inside and a != b]
    if not congested:
        return f"the slow links {sorted(links)} do not join two nodes of the layout"
    try:
        change = reroute_slow_links(plan, profile.at_microbatch(plan.microbatch_size), congested)
    except PlannerError as exc:
        return exc.message
    if not change.bytes_after < change.bytes_before:
        return "no move takes bytes off the slow links"
    return change.plan.model_copy(
        update={
            "generation": plan.generation + 1,
            "step_time_s": slowed_step_time(change.plan, profile, cluster, {}) + sync_s,
            "transition_s": 0.0,
            "candidates": (),
        }
    )


def restored_plan(
    current: Plan, healthy: Plan, profile: ModelProfile, cluster: ClusterSpec, *, only_if_faster: bool = True
) -> Plan | str:
    """The plan from before the episode as generation current + 1, if every node it needs still runs and
    (`only_if_faster`, a restore after recovery) it is estimated faster than the mitigated plan once nothing
    is slow. A revert (the mitigation measurably made the job slower) skips the estimate: it was wrong."""
    missing = set(healthy.nodes) - set(current.nodes)
    if missing:
        return f"nodes {sorted(missing)} of the healthy plan are no longer in the layout"
    healthy_s = slowed_step_time(healthy, profile, cluster, {})
    current_s = slowed_step_time(current, profile, cluster, {})
    # S2's finer micro-batches were for the slow node only: the job's own size comes back with it, even where
    # the linear estimate prices the finer split's smaller pipeline bubble as faster (it ignores the fixed
    # costs per micro-batch that the user's size pays for).
    finer = current.microbatch_size != healthy.microbatch_size
    if only_if_faster and not finer and not healthy_s < current_s * (1 - 1e-9):
        # Equal estimates (an S3 permutation): moving weights back would buy nothing.
        return "the mitigated plan is as fast as the healthy one; it stays"
    transfers = transfer_list(current.layers_by_node(), healthy.layers_by_node(), profile)
    return healthy.model_copy(
        update={
            "generation": current.generation + 1,
            "failed_nodes": current.failed_nodes,
            "transfers": tuple(transfers),
            "transition_s": 0.0,
            "candidates": (),
        }
    )
