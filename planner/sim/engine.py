"""The event loop: one training job under fail-stops, availability changes and fail-slows, for one policy.

Time advances from event to event. Between events the job makes progress at the current plan's step time
(the planner's estimate, slowed by any fail-slows in force); a transition pauses it (zero throughput) for the
charged cost. Costs charged per change, in this order:

- fail-stop or leave: the iteration in flight is lost; detection latency (`TransitionCosts.detection_s`);
  planning (the planner's measured `planning_s`, or `SimCosts.planning_s`); the plan's fixed transition
  (`fixed_transition_s`: weight transfer bytes / bandwidth and restart, nothing for rerouting, the
  checkpoint load for a checkpoint plan). A checkpoint plan also rolls the job back to the last
  checkpoint: the work since then is lost (the planner only estimates this loss as half an interval).
- join: planned at an iteration boundary (nothing lost); planning and the fixed transition; a checkpoint
  plan first saves a checkpoint (`checkpoint_save_s`) so nothing is rolled back.
- checkpoint: every policy saves one periodically (a synchronous pause of `checkpoint_save_s`), since
  every policy falls back to one when a layer loses all its replicas: every `checkpoint_interval_s` as a
  last resort, or at Young's optimum interval for the `checkpoint` policy, whose every recovery needs one.

Which plan follows a change is decided by the planner (`replan`), never here. The simulator only adds what
the planner does not model: Bamboo's redundant-computation overhead (the `redundant` policy) and the hindsight
oracle used to measure how far `adaptive` is from the best choice.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from itertools import count, pairwise

from ..errors import PlannerError
from ..plan import Plan, Policy
from ..profile import ModelProfile
from ..restorer import transfer_time
from ..spec import ClusterSpec, JobSpec, TransitionCosts
from ._mitigate import Mitigator
from ._model import FailSlow, FailStop, NodeChange, PolicyResult, Recovery, SimCosts, SimPolicy
from ._planner import CachedPlanner, Planner, default_planner
from ._slow import SlowState, slowed_step_time

ORACLE = "oracle"
# The concrete plan kinds the hindsight oracle chooses among at every change.
_ORACLE_CHOICES = (Policy.REROUTE, Policy.DYNAMIC, Policy.TEMPLATES, Policy.CHECKPOINT)


@dataclass(frozen=True, slots=True)
class Scenario:
    """Everything one run needs except the policy. Events are fixed up front, so a seed fixes them all."""

    profile: ModelProfile
    cluster: ClusterSpec
    job: JobSpec
    hours: float
    fail_stops: tuple[FailStop, ...] = ()
    changes: tuple[NodeChange, ...] = ()
    failslows: tuple[FailSlow, ...] = ()
    failure_rate_per_node_hour: float = 0.01
    costs: SimCosts = field(default_factory=SimCosts)
    mitigation: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.hours) or self.hours <= 0:
            raise PlannerError("hours", f"must be positive, got {self.hours}")
        if self.failure_rate_per_node_hour < 0:
            raise PlannerError("failure_rate", f"must be >= 0, got {self.failure_rate_per_node_hour}")
        nodes = self.cluster.nodes
        named = (
            [e.node for e in self.fail_stops]
            + [e.node for e in self.changes]
            + [e.node for e in self.failslows]
        )
        for node in named:
            if not 0 <= node < nodes:
                raise PlannerError("node", f"event names node {node}, outside 0..{nodes - 1}")

    @property
    def horizon_s(self) -> float:
        return self.hours * 3600.0


class PlannerPool:
    """One plan cache per planning context, shared by every run (seed, policy) that plans in it."""

    def __init__(self, planner: Planner | None = None) -> None:
        self.planner = planner or default_planner()
        self._caches: dict[tuple[int, ClusterSpec, JobSpec, object], CachedPlanner] = {}
        self._profiles: list[ModelProfile] = []  # keeps profiles alive so their ids stay unique

    def get(self, scenario: Scenario, cluster: ClusterSpec) -> CachedPlanner:
        costs = scenario.costs.transition
        if scenario.costs.planning_s is not None:
            # A fixed planning time stands for the search in the planner's choice too, as in the pause.
            costs = costs.model_copy(update={"search_s": scenario.costs.planning_s})
        key = (id(scenario.profile), cluster, scenario.job, costs)
        cached = self._caches.get(key)
        if cached is None:
            self._profiles.append(scenario.profile)
            cached = CachedPlanner(self.planner, scenario.profile, cluster, scenario.job, costs)
            self._caches[key] = cached
        return cached

    @property
    def calls(self) -> int:
        return sum(cache.calls for cache in self._caches.values())

    @property
    def hits(self) -> int:
        return sum(cache.hits for cache in self._caches.values())


def simulate(scenario: Scenario, policy: SimPolicy | str, pool: PlannerPool | None = None) -> PolicyResult:
    """Run one policy (`SimPolicy` or "oracle") through the scenario and report what it achieved."""
    return _Run(scenario, policy, pool or PlannerPool()).run()


class _Run:
    def __init__(self, scenario: Scenario, policy: SimPolicy | str, pool: PlannerPool) -> None:
        self.sc = scenario
        self.oracle = policy == ORACLE
        self.policy = SimPolicy.ADAPTIVE if self.oracle else SimPolicy(policy)
        self.redundant = self.policy is SimPolicy.REDUNDANT
        costs = scenario.costs
        cluster = scenario.cluster
        if self.redundant:
            memory = int(cluster.device_memory_bytes / costs.redundancy_memory_factor)
            cluster = cluster.model_copy(update={"device_memory_bytes": memory})
        self.cache = pool.get(scenario, cluster)
        self.batch = scenario.job.global_batch
        self.slowdown = 1.0 + costs.redundancy_overhead if self.redundant else 1.0
        self.result = PolicyResult(
            policy=self.policy,
            hours=scenario.hours,
            gpus_per_node=scenario.cluster.gpus_per_node,
            samples=0.0,
            failure_free_throughput=0.0,
        )
        if self.oracle:
            self.result.label = ORACLE
        self.t = 0.0
        self.progress = 0.0  # iterations done, with the fraction of the one in flight
        self.checkpoint = 0.0  # iterations saved in the last checkpoint
        self.pause_until = 0.0
        self.alive = set(range(scenario.cluster.nodes))
        self.dead: set[int] = set()
        self.pending_failed: set[int] = set()  # failures the planner could not plan around yet
        self.plan: Plan | None = None
        self.basis: Plan | None = (
            None  # the last plan in force, replanned from when a halted job gets nodes back
        )
        self.step = 0.0
        self.window_plan: Plan | None = None  # Bamboo: plan before the failures of the current transition
        self.window_failed: list[int] = []
        self.queue: list[tuple[float, int, int, object]] = []
        self._seq = count()
        self.mitigator = Mitigator(self) if scenario.mitigation else None
        self.slow = SlowState({}, {})

    # ---- bookkeeping ----------------------------------------------------------------------------------
    def push(self, time_s: float, priority: int, payload: object) -> None:
        heapq.heappush(self.queue, (time_s, priority, next(self._seq), payload))

    def throughput(self) -> float:
        if self.plan is None or self.t < self.pause_until or self.step <= 0:
            return 0.0
        return self.batch / self.step

    def mark(self) -> None:
        """Append the current state to the timeline when it differs from the last entry."""
        entry = (self.t, self.throughput(), len(self.alive))
        timeline = self.result.timeline
        if timeline and timeline[-1][1:] == entry[1:]:
            return
        if timeline and timeline[-1][0] == entry[0]:
            timeline[-1] = entry
        else:
            timeline.append(entry)

    def advance(self, until: float) -> None:
        while self.t < until:
            if self.t < self.pause_until:
                self.t = min(until, self.pause_until)
            else:
                rate = 1.0 / self.step if self.plan is not None and self.step > 0 else 0.0
                self.progress += (until - self.t) * rate
                self.t = until
            self.mark()

    def pause(self, seconds: float) -> None:
        self.pause_until = max(self.pause_until, self.t + seconds)

    def refresh_step(self) -> None:
        if self.plan is None:
            self.step = 0.0
            return
        base = slowed_step_time(self.sc.profile, self.cache.cluster, self.plan, self.slow)
        self.step = base * self.slowdown

    @property
    def checkpoint_interval_s(self) -> float:
        costs = self.sc.costs
        if self.policy is not SimPolicy.CHECKPOINT:
            return costs.transition.checkpoint_interval_s
        if costs.restart_policy_checkpoint_interval_s is not None:
            return costs.restart_policy_checkpoint_interval_s
        rate = self.sc.failure_rate_per_node_hour * self.sc.cluster.nodes
        if rate <= 0:
            return costs.transition.checkpoint_interval_s
        # Young's first-order optimum: saving more often costs more than the work it saves from loss.
        return math.sqrt(2 * costs.transition.checkpoint_save_s * 3600.0 / rate)

    def planning_s(self, plan: Plan) -> float:
        fixed = self.sc.costs.planning_s
        return plan.planning_s if fixed is None else fixed

    # ---- the run --------------------------------------------------------------------------------------
    def run(self) -> PolicyResult:
        sc = self.sc
        try:
            self.plan = self.cache.initial(self.policy.planner_policy)
        except PlannerError as exc:
            self.result.infeasible = str(exc)
            self.result.timeline.append((0.0, 0.0, len(self.alive)))
            return self.result
        self.refresh_step()
        self.result.failure_free_throughput = self.batch / self.step
        self.result.initial_layout = self.plan.layout
        self.mark()
        for stop in sc.fail_stops:
            self.push(stop.time_s, 1, stop)
        for change in sc.changes:
            self.push(change.time_s, 1, change)
        for slow in sc.failslows:
            self.push(slow.time_s, 2, ("slow-on", slow))
            self.push(slow.end_s, 2, ("slow-off", slow))
        if sc.costs.transition.checkpoint_save_s > 0:
            self.push(self.checkpoint_interval_s, 3, "checkpoint")
        horizon = sc.horizon_s
        while self.queue and self.queue[0][0] < horizon:
            time_s, _, _, payload = heapq.heappop(self.queue)
            self.advance(time_s)
            self.handle(payload)
            self.mark()
        self.advance(horizon)
        self.result.samples = self.progress * self.batch
        return self.result

    def handle(self, payload: object) -> None:
        if isinstance(payload, FailStop):
            self.lose(payload.node, "fail-stop")
        elif isinstance(payload, NodeChange):
            if payload.up:
                self.join(payload.node, "join")
            else:
                self.lose(payload.node, "leave")
        elif payload == "checkpoint":
            self.save_checkpoint()
        elif isinstance(payload, tuple):
            kind, event = payload
            if kind in {"slow-on", "slow-off"} and isinstance(event, FailSlow):
                if self.mitigator is not None:
                    self.mitigator.before_change()
                self.set_slow(event, on=kind == "slow-on")
                if self.mitigator is not None:
                    self.mitigator.started(event) if kind == "slow-on" else self.mitigator.ended(event)
            elif self.mitigator is not None:
                self.mitigator.handle(kind, event)

    def set_slow(self, event: FailSlow, *, on: bool) -> None:
        table = dict(self.slow.compute if event.kind == "compute" else self.slow.link)
        if on:
            table[event.node] = max(table.get(event.node, 1.0), event.severity)
        else:
            table.pop(event.node, None)
        if event.kind == "compute":
            self.slow = SlowState(table, self.slow.link, self.slow.rebalanced, self.slow.link_moved)
        else:
            self.slow = SlowState(self.slow.compute, table, self.slow.rebalanced, self.slow.link_moved)
        self.refresh_step()

    def save_checkpoint(self) -> None:
        costs = self.sc.costs.transition
        self.push(self.t + self.checkpoint_interval_s, 3, "checkpoint")
        if self.plan is None or self.t < self.pause_until:
            return  # nothing new to save while stopped or mid-transition
        self.checkpoint = math.floor(self.progress)
        self.pause(costs.checkpoint_save_s)

    def record_mitigation(self, strategy: str, node: int, pause: float) -> None:
        thr = self.batch / self.step if self.step > 0 else 0.0
        layout = self.plan.layout if self.plan is not None else ""
        self.result.recoveries.append(Recovery(self.t, strategy, node, strategy, layout, pause, 0.0, thr))

    # ---- fail-stops and joins ---------------------------------------------------------------------------
    def lose(self, node: int, cause: str) -> None:
        if cause == "fail-stop":
            self.dead.add(node)  # fail-stops are permanent: nothing brings the node back
        if node not in self.alive:
            return
        in_transition = self.t < self.pause_until
        self.alive.discard(node)
        before = self.plan
        if before is None:
            self.pending_failed.add(node)
            return
        in_flight = self.progress - math.floor(self.progress)
        self.progress = math.floor(self.progress)
        failed = {*self.pending_failed, node}
        force_checkpoint = False
        if self.redundant:
            if not in_transition:
                self.window_plan, self.window_failed = before, []
            force_checkpoint = any(
                _adjacent(self.window_plan or before, node, other) for other in self.window_failed
            )
            self.window_failed.append(node)
        self.replace(before, failed, set(), cause, node, in_flight * self.batch, force_checkpoint)

    def join(self, node: int, cause: str) -> None:
        if node in self.alive or node in self.dead:
            return
        self.alive.add(node)
        self.pending_failed.discard(node)
        basis = self.plan or self.basis
        if basis is None:
            return
        self.replace(basis, set(self.pending_failed), {node}, cause, node, 0.0, False)

    def replace(
        self,
        before: Plan,
        failed: set[int],
        joined: set[int],
        cause: str,
        node: int,
        lost: float,
        force_checkpoint: bool,
    ) -> None:
        rate = self.sc.failure_rate_per_node_hour
        if self.mitigator is not None:
            self.mitigator.before_change()
        chosen: Plan | None
        try:
            if self.oracle:
                chosen = self.oracle_choice(before, failed, joined, cause)
            else:
                policy = Policy.CHECKPOINT if force_checkpoint else self.policy.planner_policy
                chosen = self.cache.replan(
                    before, failed=failed, joined=joined, policy=policy, failure_rate_per_node_hour=rate
                )
        except PlannerError as exc:
            chosen = None
            reason = exc.message
        self.result.replans += 1
        if chosen is None:
            # No plan fits the nodes left: the job stops until enough nodes come back.
            self.pending_failed = failed
            self.basis = before
            self.plan = None
            self.refresh_step()
            self.result.recoveries.append(
                Recovery(self.t, cause, node, "halted: " + reason, "", 0.0, lost, 0.0)
            )
            return
        self.pending_failed = set()
        pause, rollback = self.charge(chosen, cause)
        self.progress -= rollback
        self.plan = chosen
        self.pause(pause)
        self.refresh_step()
        if self.mitigator is not None:
            self.mitigator.replanned()
        thr = self.batch / self.step if self.step > 0 else 0.0
        self.result.recoveries.append(
            Recovery(
                self.t,
                cause,
                node,
                chosen.policy.value,
                chosen.layout,
                pause,
                lost + rollback * self.batch,
                thr,
            )
        )

    def charge(self, plan: Plan, cause: str) -> tuple[float, float]:
        """(pause seconds, iterations rolled back) for switching to `plan` after `cause`."""
        costs = self.sc.costs.transition
        pause = self.planning_s(plan) + fixed_transition_s(plan, costs, self.cache.cluster)
        rollback = 0.0
        failure = cause in {"fail-stop", "leave", "s4"}
        if failure:
            pause += costs.detection_s
        if plan.policy is Policy.CHECKPOINT:
            if failure:
                rollback = max(self.progress - self.checkpoint, 0.0)
            else:
                pause += costs.checkpoint_save_s
                self.checkpoint = math.floor(self.progress)
        return pause, rollback

    def oracle_choice(self, before: Plan, failed: set[int], joined: set[int], cause: str) -> Plan:
        """The concrete plan training most samples before the next fail-stop or leave, known in hindsight."""
        horizon = self.sc.horizon_s
        upcoming = [t for t, _, _, p in self.queue if isinstance(p, (FailStop, NodeChange)) and t > self.t]
        next_change = min(upcoming, default=horizon)
        window = min(next_change, horizon) - self.t
        best: tuple[float, int, Plan] | None = None
        last_error: PlannerError | None = None
        rate = self.sc.failure_rate_per_node_hour
        for rank, policy in enumerate(_ORACLE_CHOICES):
            try:
                plan = self.cache.replan(
                    before, failed=failed, joined=joined, policy=policy, failure_rate_per_node_hour=rate
                )
            except PlannerError as exc:
                last_error = exc
                continue
            pause, rollback = self._peek_charge(plan, cause)
            step = slowed_step_time(self.sc.profile, self.cache.cluster, plan, self.slow) * self.slowdown
            gain = (
                max(window - max(pause, self.pause_until - self.t), 0.0) / step - rollback
                if step > 0
                else -rollback
            )
            if best is None or gain > best[0] + 1e-9:
                best = (gain, rank, plan)
        if best is None:
            raise last_error or PlannerError("nodes", "no plan fits the nodes left")
        return best[2]

    def _peek_charge(self, plan: Plan, cause: str) -> tuple[float, float]:
        saved = self.checkpoint
        try:
            return self.charge(plan, cause)
        finally:
            self.checkpoint = saved


def fixed_transition_s(plan: Plan, costs: TransitionCosts, cluster: ClusterSpec) -> float:
    """The part of the planner's `transition_s` that is neither its measured search time, nor detection, nor
    its estimate of the work a checkpoint restart loses (half an interval): the simulator charges those
    itself (measured planning, detection on failures only, the actual roll-back). As `planner.search`
    builds it: a checkpoint restart reloads; rerouting moves and restarts nothing; a new layout restarts
    and copies its layers, the busiest sender or receiver bounding the copy. A test pins this to the
    planner's own numbers."""
    if plan.policy is Policy.CHECKPOINT:
        return costs.checkpoint_load_s
    if plan.policy is Policy.REROUTE:
        return 0.0
    return costs.restart_s + transfer_time(plan.transfers, cluster.inter_node_bandwidth)


def _adjacent(plan: Plan, a: int, b: int) -> bool:
    """Bamboo loses a stage when a node and the neighbour holding its redundant copy both fail."""
    for pipeline in plan.pipelines:
        nodes = [stage.node for stage in pipeline.stages]
        for left, right in pairwise(nodes):
            if {left, right} == {a, b}:
                return True
    return False
