"""The seam between the simulator and the planner: the real `planner.search` by default, a stub in tests.

Plans are cached by (the plan being replaced, nodes failed, nodes joined, policy) for one (profile, cluster,
job, costs) context. The cache is sound because the planner is deterministic in those inputs: the same
current plan and the same change always give the same new plan, but for a tie of two candidates of one
layout, which their measured search times break unless `costs.search_s` fixes them. Its measured
`planning_s` is the one taken when the plan was first computed; runs of many seeds share a cache and so
share those measurements.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from ..errors import PlannerError
from ..plan import Plan, Policy
from ..profile import ModelProfile
from ..spec import ClusterSpec, JobSpec, TransitionCosts


class InitialPlanFn(Protocol):
    def __call__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        job: JobSpec,
        *,
        policy: Policy = ...,
        costs: TransitionCosts = ...,
    ) -> Plan: ...


class ReplanFn(Protocol):
    def __call__(
        self,
        current: Plan,
        profile: ModelProfile,
        cluster: ClusterSpec,
        job: JobSpec,
        *,
        failed: Collection[int] = ...,
        joined: Collection[int] = ...,
        policy: Policy = ...,
        costs: TransitionCosts = ...,
        failure_rate_per_node_hour: float = ...,
    ) -> Plan: ...


@dataclass(frozen=True, slots=True)
class Planner:
    """The two planner entry points the simulator calls (the same ones the operator calls)."""

    initial_plan: InitialPlanFn
    replan: ReplanFn


def default_planner() -> Planner:
    """The real plan search, `resilientjob.planner.search`; imported here so a stub can stand in for it."""
    from ..search import initial_plan, replan

    return Planner(initial_plan=initial_plan, replan=replan)


_Key = tuple[int, frozenset[int], frozenset[int], Policy, float]


class CachedPlanner:
    """A planner for one (profile, cluster, job, costs) context that remembers every plan it made."""

    def __init__(
        self,
        planner: Planner,
        profile: ModelProfile,
        cluster: ClusterSpec,
        job: JobSpec,
        costs: TransitionCosts,
    ) -> None:
        self.planner = planner
        self.profile = profile
        self.cluster = cluster
        self.job = job
        self.costs = costs
        self.calls = 0  # planner invocations (cache misses)
        self.hits = 0
        self._ids: dict[int, int] = {}  # id(plan) -> plan key; cached plans stay alive so ids stay unique
        self._keep: list[Plan] = []
        self._initial: dict[Policy, Plan] = {}
        self._next: dict[_Key, Plan | PlannerError] = {}

    def _key_of(self, plan: Plan) -> int:
        key = self._ids.get(id(plan))
        if key is None:
            key = len(self._keep)
            self._ids[id(plan)] = key
            self._keep.append(plan)
        return key

    def initial(self, policy: Policy) -> Plan:
        plan = self._initial.get(policy)
        if plan is None:
            self.calls += 1
            plan = self.planner.initial_plan(
                self.profile, self.cluster, self.job, policy=policy, costs=self.costs
            )
            self._initial[policy] = plan
            self._key_of(plan)
        else:
            self.hits += 1
        return plan

    def replan(
        self,
        current: Plan,
        *,
        failed: Collection[int] = (),
        joined: Collection[int] = (),
        policy: Policy,
        failure_rate_per_node_hour: float,
    ) -> Plan:
        key = (
            self._key_of(current),
            frozenset(failed),
            frozenset(joined),
            policy,
            failure_rate_per_node_hour,
        )
        found = self._next.get(key)
        if found is None:
            self.calls += 1
            try:
                found = self.planner.replan(
                    current,
                    self.profile,
                    self.cluster,
                    self.job,
                    failed=sorted(failed),
                    joined=sorted(joined),
                    policy=policy,
                    costs=self.costs,
                    failure_rate_per_node_hour=failure_rate_per_node_hour,
                )
            except PlannerError as exc:
                # Impossible requests are deterministic too: remember the answer, not just the plans.
                found = exc
            self._next[key] = found
            if isinstance(found, Plan):
                self._key_of(found)
        else:
            self.hits += 1
        if isinstance(found, PlannerError):
            raise found
        return found
