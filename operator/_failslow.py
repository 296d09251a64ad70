"""Fail-slow mitigation for one job (Falcon section 5), pure: no I/O.

Agents run the planner's BOCD + verification on their own iteration times and send change-point reports;
`FailSlowTracker` turns them into the events of Falcon's ski-rental controller
(`planner.failslow.MitigationController`) and feeds it the slow nodes' iteration times. When the time lost
pays for the next strategy, the tracker answers with a `Mitigation`, which the reconciler turns into a plan
and publishes through the same generation path as a fail-stop:

- S2 (`microbatch`): the pipelines keep their stages; micro-batches move off the pipelines through slow nodes
  (`microbatch_plan`: `balance.balance_monotone` over the exact 1F1B makespans with the slow stages slowed);
- S3 (`topology`): stragglers are consolidated into as few stages as possible (`topology_plan`:
  `failslow.consolidate_stragglers` on the DP x PP grid; symmetric layouts only);
- S4 (`replace`): the slow nodes are handed to the fail-stop planner as failed, but their pods stay up
  ("parked") so that their probe steps can show the recovery;
- `restore`: a recovery change point ends the episode; parked nodes rejoin through the planner, otherwise the
  healthy plan from before the episode comes back if it is estimated faster.

The controller's state lives in memory: an operator restarted mid-episode starts the episode again at S1 (the
plans already published, parked nodes and the plan to restore are in the committed announcement).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from resilientjob.agent.telemetry_messages import IterationRecord, SlowKind, SlowReport
from resilientjob.planner._errors import PlannerError
from resilientjob.planner.balance import balance_monotone
from resilientjob.planner.estimator import pipeline_time, send_time
from resilientjob.planner.failslow import (
    ChangeEvent,
    ChangeKind,
    MitigationController,
    MitigationCosts,
    NodeGrid,
    RootCause,
    Strategy,
    consolidate_stragglers,
)
from resilientjob.planner.plan import PipelinePlan, Plan
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.restorer import transfer_list
from resilientjob.planner.spec import ClusterSpec

from .api import FailSlowSpec


class Action(StrEnum):
    """What the reconciler publishes for a mitigation (the strategy names of the status)."""

    MICROBATCH = "microbatch"
    TOPOLOGY = "topology"
    REPLACE = "replace"
    RESTORE = "restore"


_ACTIONS = {
    Strategy.MICROBATCH: Action.MICROBATCH,
    Strategy.TOPOLOGY: Action.TOPOLOGY,
    Strategy.REPLACE: Action.REPLACE,
}


@dataclass(frozen=True, slots=True)
class Mitigation:
    """Publish `action` for `nodes` (slow node -> slowdown factor) now."""

    action: Action
    factors: dict[int, float]
    reason: str
    loss_s: float
    detect_s: float

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted(self.factors))


@dataclass(slots=True)
class FailSlowTracker:
    """One job's fail-slow episode: reports and iteration times in, mitigations out."""

    spec: FailSlowSpec
    slow: dict[int, float] = field(default_factory=dict)
    """Nodes currently slow, with their slowdown (new level / healthy level)."""
    controller: MitigationController = field(init=False)
    _detect_s: float = 0.0
    _opened_at: float = 0.0
    _held: list[float] = field(default_factory=list)
    _fed: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        overheads = self.spec.overheads
        self.controller = MitigationController(
            MitigationCosts(
                microbatch_s=overheads.microbatch_s,
                topology_s=overheads.topology_s,
                replace_s=overheads.restart_s,
            )
        )

    @property
    def active(self) -> bool:
        return self.controller.active

    def report(self, report: SlowReport, now: float | None = None) -> Mitigation | None:
        """A worker's change point. A slowdown opens (or widens) the episode; the last slow node's
        recovery closes it and asks for the healthy layout back."""
        if not self.spec.enabled:
            return None
        if report.recovered:
            if self.slow.pop(report.node, None) is None or self.slow:
                return None
            self._held.clear()
            self._fed.clear()
            decision = self.controller.on_change(self._event(report))
            if decision is None:
                return None
            return Mitigation(Action.RESTORE, {report.node: 1.0}, decision.reason, decision.loss_s, 0.0)
        if report.slowdown < self.spec.slowdown_threshold:
            return None
        if not self.controller.active:
            self.controller.on_change(self._event(report))
            onset = max(1, report.step - report.onset_step + 1)
            self._detect_s = onset * (report.level_s or report.baseline_s * report.slowdown)
            self._opened_at = time.monotonic() if now is None else now
        self.slow[report.node] = report.slowdown
        cause = RootCause.COMPUTE if report.kind is SlowKind.COMPUTE else RootCause.COMMUNICATION
        self.controller.localized((cause,), (report.node,))
        return None

    def iteration(self, record: IterationRecord, now: float | None = None) -> Mitigation | None:
        """One step of a worker. Only the slowest node's steps count, once per step: in synchronous
        training every node waits for it, so its excess over the healthy step is the time the job loses."""
        if not self.controller.active or not self.slow:
            return None
        slowest = max(self.slow, key=lambda node: (self.slow[node], -node))
        if record.node != slowest or record.step <= self._fed.get(record.node, -1):
            return None
        self._fed[record.node] = record.step
        # Slowdowns shorter than min_duration_s are ignored: hold their loss until the episode is that old.
        self._held.append(record.seconds)
        clock = time.monotonic() if now is None else now
        if clock - self._opened_at < self.spec.min_duration_s:
            return None
        decision = None
        for seconds in self._held:
            decision = self.controller.on_iteration(seconds) or decision
            if decision is not None:
                break
        self._held.clear()
        if decision is None or decision.strategy not in _ACTIONS:
            return None
        return Mitigation(
            _ACTIONS[decision.strategy], dict(self.slow), decision.reason, decision.loss_s, self._detect_s
        )

    def forget(self, nodes: Iterable[int]) -> None:
        """Failed nodes leave the episode; with no slow node left it ends without a restore (the fail-stop
        replan already chose the layout)."""
        for node in nodes:
            self.slow.pop(node, None)
        if not self.slow and self.controller.active:
            self.controller = MitigationController(self.controller.costs)
            self._held.clear()
            self._fed.clear()

    @staticmethod
    def _event(report: SlowReport) -> ChangeEvent:
        before = report.baseline_s
        after = report.level_s or before * report.slowdown
        kind = ChangeKind.RECOVERY if report.recovered else ChangeKind.SLOWDOWN
        onset = min(report.onset_step, report.step)
        return ChangeEvent(index=onset, kind=kind, before_s=before, after_s=after, detected_at=report.step)


# ---- the plans of S2 and S3 ------------------------------------------------------------------------------
def _pipeline_time(
    profile: ModelProfile,
    cluster: ClusterSpec,
    pipeline: PipelinePlan,
    microbatches: int,
    factors: dict[int, float],
) -> float:
    """Exact 1F1B makespan of one pipeline with the stages on slow nodes slowed by their factor."""
    forward: list[float] = []
    backward: list[float] = []
    sends: list[float] = []
    stages = pipeline.stages
    for index, stage in enumerate(stages):
        fwd, bwd = profile.stage_times(stage.layers[0], stage.layers[1], len(stage.gpus))
        factor = 1.0 if stage.rerouted else factors.get(stage.node, 1.0)
        forward.append(fwd * factor)
        backward.append(bwd * factor)
        if index + 1 < len(stages):
            same = stages[index + 1].node == stage.node
            sends.append(send_time(profile, cluster, stage.layers[1] - 1, same))
    return pipeline_time(forward, backward, microbatches, sends)


def slowed_step_time(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, factors: dict[int, float]
) -> float:
    """The plan's pipeline makespan (no gradient sync) with slow nodes slowed: the quantity S2 and S3
    minimise, and, with no factors, the healthy estimate a restore compares."""
    return max(
        _pipeline_time(profile, cluster, pipeline, pipeline.microbatches, factors)
        for pipeline in plan.pipelines
    )


def sync_time(healthy: Plan, profile: ModelProfile, cluster: ClusterSpec) -> float:
    """What the planner's step estimate adds to the pipeline makespan (gradient sync), from the healthy
    plan: a mitigated plan's published estimate is its slowed makespan plus this."""
    return max(0.0, healthy.step_time_s - slowed_step_time(healthy, profile, cluster, {}))


def microbatch_plan(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, factors: dict[int, float], sync_s: float
) -> Plan | str:
    """S2: the same stages with micro-batches re-split to minimise the slowed makespan; or why not."""
    if len(plan.pipelines) < 2:
        return "one pipeline only: there is no other pipeline to take micro-batches"
    total = sum(pipeline.microbatches for pipeline in plan.pipelines)
    cache: dict[tuple[int, int], float] = {}

    def cost(index: int, count: int) -> float:
        key = (index, count)
        if key not in cache:
            cache[key] = _pipeline_time(profile, cluster, plan.pipelines[index], count, factors)
        return cache[key]

    counts = balance_monotone(cost, len(plan.pipelines), total)
    if tuple(counts) == tuple(p.microbatches for p in plan.pipelines):
        return "the current split is already the best for these slowdowns"
    pipelines = tuple(
        pipeline.model_copy(update={"microbatches": count})
        for pipeline, count in zip(plan.pipelines, counts, strict=True)
    )
    before = slowed_step_time(plan, profile, cluster, factors)
    after = max(cost(index, count) for index, count in enumerate(counts))
    if after >= before * (1 - 1e-9):
        return "no split is faster than the current one"
    return plan.model_copy(
        update={
            "generation": plan.generation + 1,
            "pipelines": pipelines,
            "step_time_s": after + sync_s,
            "transfers": (),
            "transition_s": 0.0,
            "candidates": (),
        }
    )


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


def topology_plan(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, factors: dict[int, float], sync_s: float
) -> Plan | str:
    """S3: stragglers packed into as few (interior) stages as possible, weights copied peer-to-peer."""
    grid = _grid(plan)
    if isinstance(grid, str):
        return grid
    stragglers = [node for node in factors if node in set(grid.nodes)]
    change = consolidate_stragglers(grid, stragglers, profile)
    if not change.moved:
        return "the stragglers already sit in as few stages as they can"
    pipelines = tuple(
        pipeline.model_copy(
            update={
                "stages": tuple(
                    stage.model_copy(update={"node": node})
                    for stage, node in zip(pipeline.stages, row, strict=True)
                )
            }
        )
        for pipeline, row in zip(plan.pipelines, change.after.rows, strict=True)
    )
    moved = plan.model_copy(update={"pipelines": pipelines})
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


def restored_plan(current: Plan, healthy: Plan, profile: ModelProfile, cluster: ClusterSpec) -> Plan | str:
    """The plan from before the episode as generation current + 1, if every node it needs still runs and it
    is estimated faster than the mitigated plan once nothing is slow."""
    missing = set(healthy.nodes) - set(current.nodes)
    if missing:
        return f"nodes {sorted(missing)} of the healthy plan are no longer in the layout"
    healthy_s = slowed_step_time(healthy, profile, cluster, {})
    current_s = slowed_step_time(current, profile, cluster, {})
    if not healthy_s < current_s * (1 - 1e-9):
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
