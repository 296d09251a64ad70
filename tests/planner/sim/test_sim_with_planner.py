"""The simulator on the real plan search (`planner.search`): failure-free throughput, a single failure by
hand, determinism, and agreement with the planner's own transition estimate."""

from __future__ import annotations

import math

import pytest

from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile
from resilientjob.planner.plan import Policy
from resilientjob.planner.restorer import transfer_time
from resilientjob.planner.search import initial_plan, replan
from resilientjob.planner.sim import FailStop, PlannerPool, Scenario, SimCosts, SimPolicy, simulate
from resilientjob.planner.sim.engine import fixed_transition_s
from resilientjob.planner.sim.runner import random_scenario
from resilientjob.planner.spec import TransitionCosts

COSTS = TransitionCosts(checkpoint_save_s=0.0)
CLUSTER = ClusterSpec(nodes=8)
JOB = JobSpec(global_batch=32, microbatch_size=1)


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    return ModelProfile.load("gpt3-2.7b")


@pytest.mark.parametrize("policy", list(SimPolicy))
def test_failure_free_throughput_is_the_estimators(profile: ModelProfile, policy: SimPolicy) -> None:
    scenario = Scenario(
        profile=profile, cluster=CLUSTER, job=JOB, hours=2.0, costs=SimCosts(transition=COSTS, planning_s=0.0)
    )
    result = simulate(scenario, policy)
    cluster = CLUSTER
    if policy is SimPolicy.REDUNDANT:
        cluster = CLUSTER.model_copy(update={"device_memory_bytes": CLUSTER.device_memory_bytes // 2})
    plan = initial_plan(profile, cluster, JOB, policy=policy.planner_policy)
    overhead = 1.5 if policy is SimPolicy.REDUNDANT else 1.0
    assert result.avg_throughput == pytest.approx(plan.throughput / overhead, rel=1e-12)
    assert result.failure_free_throughput == pytest.approx(plan.throughput / overhead, rel=1e-12)


@pytest.mark.parametrize("policy", [Policy.REROUTE, Policy.DYNAMIC, Policy.CHECKPOINT, Policy.AUTO])
def test_fixed_transition_matches_the_planners_estimate(profile: ModelProfile, policy: Policy) -> None:
    costs = TransitionCosts()
    start = initial_plan(profile, CLUSTER, JOB, policy=policy)
    plan = replan(start, profile, CLUSTER, JOB, failed=[3], policy=policy, costs=costs)
    expected_loss = costs.checkpoint_interval_s / 2 if plan.policy is Policy.CHECKPOINT else 0.0
    search_s = (
        plan.transition_s - costs.detection_s - expected_loss - fixed_transition_s(plan, costs, CLUSTER)
    )
    # What is left is the planner's measured search time for the chosen candidate: part of planning_s.
    assert -1e-9 <= search_s <= plan.planning_s + 1e-9


def test_single_failure_matches_hand_calculation(profile: ModelProfile) -> None:
    costs = SimCosts(transition=COSTS, planning_s=0.25)
    fail_at = 1234.5
    scenario = Scenario(
        profile=profile, cluster=CLUSTER, job=JOB, hours=1.0, fail_stops=(FailStop(fail_at, 5),), costs=costs
    )
    result = simulate(scenario, SimPolicy.DYNAMIC)
    before = initial_plan(profile, CLUSTER, JOB, policy=Policy.DYNAMIC)
    after = replan(before, profile, CLUSTER, JOB, failed=[5], policy=Policy.DYNAMIC, costs=COSTS)
    # Detection, the fixed planning time, a restart and the layer copies (the busiest node bounds them).
    copy_s = transfer_time(after.transfers, CLUSTER.inter_node_bandwidth)
    pause = COSTS.detection_s + 0.25 + COSTS.restart_s + copy_s
    done = math.floor(fail_at / before.step_time_s)  # the iteration in flight at the failure is lost
    expected = JOB.global_batch * (done + (3600.0 - fail_at - pause) / after.step_time_s)
    (recovery,) = result.recoveries
    assert recovery.layout == after.layout
    assert recovery.pause_s == pytest.approx(pause, rel=1e-12)
    assert result.samples == pytest.approx(expected, rel=1e-12)


def test_same_seed_same_run_across_fresh_caches(profile: ModelProfile) -> None:
    costs = SimCosts(planning_s=0.1)

    def run(seed: int) -> dict[str, object]:
        scenario = random_scenario(profile, CLUSTER, JOB, hours=3.0, failure_rate=0.1, seed=seed, costs=costs)
        return simulate(scenario, SimPolicy.ADAPTIVE, PlannerPool()).to_json()

    first, second, other = run(5), run(5), run(6)
    assert first == second
    assert first != other
    assert first["recoveries"]
