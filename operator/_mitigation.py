"""The plan of a fail-slow mitigation (S2, S3, S4, restore) for the committed generation, off the event loop.

`mitigation_message` answers the announcement to commit, or a sentence saying why nothing is published; the
controller commits it through the same path as a fail-stop decision.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.plan import Plan
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.restorer import transfer_list
from resilientjob.planner.spec import ClusterSpec
from resilientjob.protocol.messages import PlanAnnouncement

from . import _failslow, api
from ._failslow import Action, Mitigation
from ._redis_state import announcement
from .planning import PlannerInputs, plan_next


async def mitigation_message(
    spec: api.ResilientJobSpec,
    inputs: PlannerInputs,
    current: PlanAnnouncement,
    mitigation: Mitigation,
    running: Callable[[int], bool],
) -> PlanAnnouncement | str:
    """The next generation for `mitigation`, or why there is none. `running(node)` says whether a node's pod
    is up (parked nodes that still run may rejoin on restore)."""
    started = time.perf_counter()
    try:
        built = await asyncio.to_thread(_plan, spec, inputs, current, mitigation, running)
    except PlannerError as exc:
        return f"{exc}"
    if isinstance(built, str):
        return built
    result, parked, restore = built
    plan = result.model_copy(update={"planning_s": time.perf_counter() - started})
    action = mitigation.action
    trigger = api.Reason.NODE_RECOVERED if action is Action.RESTORE else api.Reason.NODE_SLOW
    links = f" and links {[f'{a}->{b}' for a, b in mitigation.links]}" if mitigation.links else ""
    why = f"fail-slow {action} for nodes {list(mitigation.nodes)}{links}: {mitigation.reason}"
    if mitigation.measured:
        why += f"; {mitigation.measured}"
    estimate = _estimated(current.plan, plan, inputs, mitigation)
    if estimate:
        why += f"; {estimate}"
    return announcement(
        plan,
        trigger=trigger,
        nodes=mitigation.nodes,
        reason=why,
        strategy=str(action),
        detect_s=mitigation.detect_s,
        steps=mitigation.steps,
        parked=parked,
        restore=restore,
    )


def _estimated(before: Plan, after: Plan, inputs: PlannerInputs, mitigation: Mitigation) -> str:
    """The planner's pipeline makespan with the slow nodes slowed, on the current layout and on the new
    one (what a rung expects to win; the next rung's decision says what it measured)."""
    if mitigation.action is Action.RESTORE:
        return ""
    try:
        old = _failslow.slowed_step_time(before, inputs.profile, inputs.cluster, mitigation.factors)
        new = _failslow.slowed_step_time(after, inputs.profile, inputs.cluster, mitigation.factors)
    except PlannerError:
        return ""
    moved = ""
    if mitigation.action is Action.MICROBATCH:
        # Samples per replica, not micro-batches: a finer split changes the count but not the work.
        had, has = (_samples_per_replica(plan) for plan in (before, after))
        moved = f"; samples per replica {had} -> {has}"
        drained = [node for node in after.idle_nodes if node not in before.idle_nodes]
        if drained:
            moved += f"; nodes {drained} drained (they keep their weights and probe their devices)"
    finer = (
        f"; micro-batches of {before.microbatch_size} -> {after.microbatch_size} samples"
        if after.microbatch_size != before.microbatch_size
        else ""
    )
    return f"estimated {old:.3g}s -> {new:.3g}s per step (pipelines, slow nodes slowed){moved}{finer}"


def _samples_per_replica(plan: Plan) -> list[int]:
    return [pipeline.microbatches * plan.microbatch_size for pipeline in plan.pipelines]


def replaced_nodes(mitigation: Mitigation) -> list[int]:
    """The nodes S4 takes out: every slow node that is not only the end of a slow link (a slow device,
    also one at a link's end), and for the slow links left as few ends as cover them all (a congested link
    is gone once either end is; parking both would leave their pipelines short of a node for nothing).
    Greedy cover: the end on most uncovered links first, the lower node on ties."""
    links = {(a, b) for a, b in mitigation.links if a != b}
    ends = {node for link in links for node in link}
    devices = set(mitigation.devices)
    out = {node for node in mitigation.factors if node not in ends or node in devices}
    uncovered = {link for link in links if not set(link) & out}
    while uncovered:
        counts: dict[int, int] = {}
        for link in uncovered:
            for node in link:
                counts[node] = counts.get(node, 0) + 1
        chosen = min(counts, key=lambda node: (-counts[node], node))
        out.add(chosen)
        uncovered = {link for link in uncovered if chosen not in link}
    return sorted(out)


def _plan(
    spec: api.ResilientJobSpec,
    inputs: PlannerInputs,
    current: PlanAnnouncement,
    mitigation: Mitigation,
    running: Callable[[int], bool],
) -> tuple[Plan, set[int], Plan | None] | str:
    action = mitigation.action
    healthy = current.restore or current.plan
    parked = set(current.parked)
    profile, cluster = inputs.profile, inputs.cluster
    if action is Action.MICROBATCH:
        sync_s = _failslow.sync_time(healthy, profile, cluster)
        result = _failslow.microbatch_plan(
            current.plan, profile, cluster, mitigation.factors, sync_s, spec.fail_slow.micro_batch_split
        )
    elif action is Action.TOPOLOGY:
        sync_s = _failslow.sync_time(healthy, profile, cluster)
        result = topology_change(current.plan, profile, cluster, mitigation, sync_s)
    elif action is Action.REPLACE:
        # S4 hands the slow nodes to the fail-stop planner; their pods stay up (parked) so that their probe
        # steps can show the recovery. The healthy plan cannot come back without them.
        out = [n for n in replaced_nodes(mitigation) if n in current.plan.nodes]
        result = plan_next(spec, inputs, current.plan, failed=out)
        parked |= set(out)
    elif action is Action.REVERT:
        # The episode's first rung (S2 or S3: the same nodes) made the job slower: its plan goes, whatever
        # the estimates say, and the episode's healthy plan stays the one to restore.
        if current.restore is None:
            return "no mitigation was published; nothing to undo"
        healthy = current.restore
        result = _failslow.restored_plan(current.plan, healthy, profile, cluster, only_if_faster=False)
        return result if isinstance(result, str) else (result, parked, healthy)
    else:
        back = [n for n in sorted(parked) if running(n)]
        if back:
            return plan_next(spec, inputs, current.plan, joined=back), set(), None
        if current.restore is None:
            return "no mitigation was published; nothing to undo"
        result = _failslow.restored_plan(current.plan, current.restore, profile, cluster)
        return result if isinstance(result, str) else (result, set(), None)
    return result if isinstance(result, str) else (result, parked, healthy)


def topology_change(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, mitigation: Mitigation, sync_s: float
) -> Plan | str:
    """S3: slow links off the data-parallel path (a), then compute stragglers consolidated (b)."""
    endpoints = {node for link in mitigation.links for node in link}
    stragglers = {n: f for n, f in mitigation.factors.items() if n not in endpoints}
    reasons: list[str] = []
    result = plan
    if mitigation.links:
        moved = _failslow.link_plan(result, profile, cluster, mitigation.links, sync_s)
        if isinstance(moved, str):
            reasons.append(moved)
        else:
            result = moved
    if stragglers or not mitigation.links:
        consolidated = _failslow.topology_plan(
            result, profile, cluster, stragglers or mitigation.factors, sync_s
        )
        if isinstance(consolidated, str):
            reasons.append(consolidated)
        elif result is plan:
            result = consolidated
        else:
            # Both steps in one generation: the copies go from the current layout straight to the last.
            transfers = transfer_list(plan.layers_by_node(), consolidated.layers_by_node(), profile)
            result = consolidated.model_copy(
                update={"generation": plan.generation + 1, "transfers": tuple(transfers)}
            )
    return "; ".join(reasons) if result is plan else result
