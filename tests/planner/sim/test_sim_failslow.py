"""Fail-slows in the simulator: slowed step times from the estimator, and Falcon's ladder acting on them."""

from __future__ import annotations

import pytest
from sim_stub_planner import StubPlanner

from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile
from resilientjob.planner.estimator import allreduce_time, symmetric_step_time
from resilientjob.planner.restorer import allreduce_rounds
from resilientjob.planner.sim import (
    FailSlow,
    FailSlowKind,
    PlannerPool,
    Scenario,
    SimCosts,
    SimPolicy,
    simulate,
)
from resilientjob.planner.sim._slow import SlowState, rebalanced_microbatches, slowed_step_time
from resilientjob.planner.spec import TransitionCosts


def _plan(stub: StubPlanner, profile: ModelProfile, nodes: int = 4):  # type: ignore[no-untyped-def]
    return stub.initial_plan(profile, ClusterSpec(nodes=nodes), JobSpec(global_batch=32, microbatch_size=1))


def test_healthy_step_is_the_plans(stub: StubPlanner, small_profile: ModelProfile) -> None:
    plan = _plan(stub, small_profile)
    assert slowed_step_time(small_profile, ClusterSpec(nodes=4), plan, SlowState({}, {})) == plan.step_time_s


def test_compute_slowdown_matches_the_1f1b_formula(stub: StubPlanner, small_profile: ModelProfile) -> None:
    plan = _plan(stub, small_profile)  # DP2 x PP2, 16 micro-batches each, 0.04 s + 0.08 s per stage
    slowed = slowed_step_time(small_profile, ClusterSpec(nodes=4), plan, SlowState({0: 2.0}, {}))
    # Node 0 is stage 0 of pipeline 0, now 0.08 + 0.16 s per micro-batch: it is busy 16 * 0.24 s and idles
    # once, 0.04 s, waiting for stage 1's first backward (its forward 0.04 + backward 0.08 after stage 0's
    # first forward 0.08 ends at 0.2 s, while stage 0's second forward ends at 0.16 s).
    expected = 0.24 * 16 + 0.04
    assert slowed == pytest.approx(expected)
    assert slowed > symmetric_step_time(2, 16, 0.04, 0.08)


def test_rebalancing_moves_micro_batches_off_the_slow_pipeline(
    stub: StubPlanner, small_profile: ModelProfile
) -> None:
    plan = _plan(stub, small_profile)
    cluster = ClusterSpec(nodes=4)
    counts = rebalanced_microbatches(small_profile, cluster, plan, {0: 2.0}, {})
    assert sum(counts) == 32 and counts[0] < counts[1]
    mitigated = slowed_step_time(small_profile, cluster, plan, SlowState({0: 2.0}, {}, rebalanced=True))
    unmitigated = slowed_step_time(small_profile, cluster, plan, SlowState({0: 2.0}, {}))
    assert plan.step_time_s < mitigated < unmitigated


def test_link_slowdown_slows_the_allreduce_until_moved(
    stub: StubPlanner, small_profile: ModelProfile
) -> None:
    plan = _plan(stub, small_profile)
    cluster = ClusterSpec(nodes=4)
    sync = allreduce_time(small_profile, cluster, allreduce_rounds(plan.pipelines), 2)
    assert sync > 0
    slowed = slowed_step_time(small_profile, cluster, plan, SlowState({}, {1: 3.0}))
    assert slowed == pytest.approx(plan.step_time_s + 2 * sync)
    moved = slowed_step_time(small_profile, cluster, plan, SlowState({}, {1: 3.0}, link_moved=True))
    assert moved == pytest.approx(plan.step_time_s)  # the stub's profile sends nothing between stages


def test_mitigation_recovers_throughput(stub: StubPlanner, small_profile: ModelProfile) -> None:
    slow = (FailSlow(600.0, 0, FailSlowKind.COMPUTE, 2.0, 1800.0),)
    costs = SimCosts(transition=TransitionCosts(checkpoint_save_s=0.0), planning_s=0.5)
    common = {
        "profile": small_profile,
        "cluster": ClusterSpec(nodes=4),
        "job": JobSpec(global_batch=32, microbatch_size=1),
        "hours": 1.0,
        "failslows": slow,
        "costs": costs,
    }
    pool = PlannerPool(stub.as_planner())
    off = simulate(Scenario(**common), SimPolicy.ADAPTIVE, pool)  # type: ignore[arg-type]
    on = simulate(Scenario(**common, mitigation=True), SimPolicy.ADAPTIVE, pool)  # type: ignore[arg-type]
    healthy = off.failure_free_throughput
    assert off.avg_throughput < on.avg_throughput < healthy
    steps = [r.cause for r in on.recoveries]
    assert steps[0] == "s2"
    # S2 follows detection (a few iterations) plus enough slow iterations to repay its 2 s pause.
    assert 600.0 < on.recoveries[0].time_s < 600.0 + 30 * 3.0


def test_detection_delay_comes_from_the_change_point_detector() -> None:
    from resilientjob.planner.sim._mitigate import detection_delay

    delay = detection_delay(1.5)
    assert delay is not None and 1 <= delay <= 10  # issue 3: flagged within 10 iterations
    assert detection_delay(1.05) is None  # below the 10% verification bar: jitter, never a fail-slow


def test_decisions_come_from_the_failslow_controller(
    stub: StubPlanner, small_profile: ModelProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    from resilientjob.planner.failslow import MitigationController
    from resilientjob.planner.sim import _mitigate

    fed: list[float] = []

    class Recording(MitigationController):
        def on_iteration(self, seconds: float):  # type: ignore[no-untyped-def]
            fed.append(seconds)
            return super().on_iteration(seconds)

    monkeypatch.setattr(_mitigate, "MitigationController", Recording)
    slow = (FailSlow(600.0, 0, FailSlowKind.COMPUTE, 2.0, 1800.0),)
    scenario = Scenario(
        profile=small_profile,
        cluster=ClusterSpec(nodes=4),
        job=JobSpec(global_batch=32, microbatch_size=1),
        hours=1.0,
        failslows=slow,
        mitigation=True,
        costs=SimCosts(transition=TransitionCosts(checkpoint_save_s=0.0), planning_s=0.5),
    )
    result = simulate(scenario, SimPolicy.ADAPTIVE, PlannerPool(stub.as_planner()))
    assert fed and all(seconds > result.failure_free_throughput**-1 * 32 for seconds in fed)
    assert [r.cause for r in result.recoveries][:1] == ["s2"]
