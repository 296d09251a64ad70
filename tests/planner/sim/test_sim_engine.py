"""The event loop against a stub planner: hand-checkable numbers, determinism, and proof that the simulator
calls the planner it is given (so in production the real `replan`, not a copy)."""

from __future__ import annotations

import math

import pytest
from sim_stub_planner import StubPlanner

from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile
from resilientjob.planner.plan import Policy
from resilientjob.planner.sim import (
    ORACLE,
    PAPER_POLICIES,
    FailStop,
    NodeChange,
    PlannerPool,
    Scenario,
    SimCosts,
    SimPolicy,
    simulate,
)
from resilientjob.planner.spec import TransitionCosts

RESTART_S = 10.0
NO_CHECKPOINTS = TransitionCosts(checkpoint_save_s=0.0, detection_s=2.0, restart_s=RESTART_S)


def _scenario(profile: ModelProfile, nodes: int = 4, **extra: object) -> Scenario:
    costs = extra.pop("costs", SimCosts(transition=NO_CHECKPOINTS, planning_s=0.5))
    return Scenario(
        profile=profile,
        cluster=ClusterSpec(nodes=nodes),
        job=JobSpec(global_batch=32, microbatch_size=1),
        hours=1.0,
        costs=costs,  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("policy", list(SimPolicy))
def test_failure_free_throughput_is_the_estimators(
    stub: StubPlanner, small_profile: ModelProfile, policy: SimPolicy
) -> None:
    scenario = _scenario(small_profile)
    result = simulate(scenario, policy, PlannerPool(stub.as_planner()))
    plan = stub.initial_plan(scenario.profile, scenario.cluster, scenario.job)
    expected = plan.throughput / (1.5 if policy is SimPolicy.REDUNDANT else 1.0)
    assert result.avg_throughput == pytest.approx(expected, rel=1e-12)
    assert result.recoveries == []


def test_single_failure_matches_hand_calculation(stub: StubPlanner, small_profile: ModelProfile) -> None:
    # 8 equal layers (0.01 s forward + 0.02 s backward each), 4 nodes: DP2 x PP2 with 16 micro-batches per
    # pipeline, so one step is (2 + 16 - 1) * 4 * 0.03 = 2.04 s. Node 3 fails at 1000.3 s: the iteration in
    # flight is lost (490 done), the job pauses 2 s detection + 0.5 s planning + 10 s restart (no layer moves
    # in the stub's plans), then runs
    # DP1 x PP2 with 32 micro-batches: (2 + 32 - 1) * 0.12 = 3.96 s per step until 3600 s.
    scenario = _scenario(small_profile, fail_stops=(FailStop(1000.3, 3),))
    result = simulate(scenario, SimPolicy.ADAPTIVE, PlannerPool(stub.as_planner()))
    before = math.floor(1000.3 / 2.04)
    after = (3600.0 - 1000.3 - (2.0 + 0.5 + RESTART_S)) / 3.96
    assert before == 490
    assert result.samples == pytest.approx(32 * (before + after), rel=1e-12)
    (recovery,) = result.recoveries
    assert recovery.pause_s == pytest.approx(12.5)
    assert recovery.lost_samples == pytest.approx(32 * (1000.3 / 2.04 - before))
    assert recovery.throughput_after == pytest.approx(32 / 3.96)
    assert [entry[1:] for entry in result.timeline] == [
        (pytest.approx(32 / 2.04), 4),
        (0.0, 3),
        (pytest.approx(32 / 3.96), 3),
    ]


def test_checkpoint_policy_rolls_back_to_the_last_checkpoint(
    stub: StubPlanner, small_profile: ModelProfile
) -> None:
    costs = SimCosts(
        transition=TransitionCosts(checkpoint_save_s=5.0, detection_s=2.0),
        planning_s=0.5,
        restart_policy_checkpoint_interval_s=600.0,
    )
    scenario = _scenario(small_profile, fail_stops=(FailStop(1000.3, 3),), costs=costs)
    result = simulate(scenario, SimPolicy.CHECKPOINT, PlannerPool(stub.as_planner()))
    (recovery,) = result.recoveries
    saved = math.floor(600.0 / 2.04)  # the checkpoint at 600 s holds the iterations completed by then
    done_at_failure = math.floor(600.0 / 2.04 + (1000.3 - 605.0) / 2.04)
    assert recovery.policy == Policy.CHECKPOINT
    in_flight = 600.0 / 2.04 + (1000.3 - 605.0) / 2.04 - done_at_failure
    assert recovery.lost_samples == pytest.approx(32 * (in_flight + done_at_failure - saved))


def test_simulator_calls_the_planner_it_is_given(stub: StubPlanner, small_profile: ModelProfile) -> None:
    scenario = _scenario(
        small_profile,
        fail_stops=(FailStop(100.0, 1),),
        changes=(NodeChange(200.0, 2, up=False), NodeChange(300.0, 2, up=True)),
    )
    simulate(scenario, SimPolicy.REROUTE, PlannerPool(stub.as_planner()))
    assert stub.calls == [
        ("initial", (), (), Policy.REROUTE),
        ("replan", (1,), (), Policy.REROUTE),
        ("replan", (2,), (), Policy.REROUTE),
        ("replan", (), (2,), Policy.REROUTE),
    ]


def test_plans_are_cached_across_runs(stub: StubPlanner, small_profile: ModelProfile) -> None:
    pool = PlannerPool(stub.as_planner())
    scenario = _scenario(small_profile, fail_stops=(FailStop(100.0, 1),))
    first = simulate(scenario, SimPolicy.ADAPTIVE, pool)
    second = simulate(scenario, SimPolicy.ADAPTIVE, pool)
    assert len(stub.calls) == 2 and pool.hits == 2
    assert first.to_json() == second.to_json()


def test_redundant_falls_back_to_checkpoint_when_neighbours_fail_together(
    stub: StubPlanner, small_profile: ModelProfile
) -> None:
    # Nodes 0 and 1 are stages 0 and 1 of pipeline 0: Bamboo loses the stage when both go within one recovery.
    scenario = _scenario(small_profile, fail_stops=(FailStop(100.0, 0), FailStop(101.0, 1)))
    result = simulate(scenario, SimPolicy.REDUNDANT, PlannerPool(stub.as_planner()))
    assert [call[3] for call in stub.calls] == [Policy.DYNAMIC, Policy.DYNAMIC, Policy.CHECKPOINT]
    assert result.recoveries[-1].policy == Policy.CHECKPOINT


def test_job_halts_when_no_plan_fits_and_resumes_on_join(
    stub: StubPlanner, small_profile: ModelProfile
) -> None:
    scenario = _scenario(
        small_profile,
        nodes=2,
        changes=(
            NodeChange(100.0, 0, up=False),
            NodeChange(200.0, 1, up=False),
            NodeChange(300.0, 0, up=True),
        ),
    )
    result = simulate(scenario, SimPolicy.ADAPTIVE, PlannerPool(stub.as_planner()))
    causes = [(r.cause, r.policy.split(":")[0]) for r in result.recoveries]
    assert causes == [("leave", "dynamic"), ("leave", "halted"), ("join", "dynamic")]
    assert result.timeline[-1][1] > 0 and result.timeline[-1][2] == 1


def test_oracle_asks_the_planner_for_every_concrete_policy(
    stub: StubPlanner, small_profile: ModelProfile
) -> None:
    scenario = _scenario(small_profile, fail_stops=(FailStop(100.0, 1),))
    result = simulate(scenario, ORACLE, PlannerPool(stub.as_planner()))
    asked = {call[3] for call in stub.calls if call[0] == "replan"}
    assert asked == {Policy.REROUTE, Policy.DYNAMIC, Policy.TEMPLATES, Policy.CHECKPOINT}
    assert result.name == ORACLE
    # With equal layouts, any choice but a checkpoint restart (which rolls back) is best.
    assert result.recoveries[0].policy != Policy.CHECKPOINT


def test_paper_policies_are_named_like_the_planner() -> None:
    assert [p.value for p in PAPER_POLICIES] == [
        "adaptive",
        "templates",
        "reroute",
        "checkpoint",
        "redundant",
    ]
    assert SimPolicy.ADAPTIVE.planner_policy is Policy.AUTO


def test_cumulative_samples_end_at_the_reported_total(stub: StubPlanner, small_profile: ModelProfile) -> None:
    from resilientjob.planner.sim.plot import cumulative_samples, windowed_throughput

    costs = SimCosts(
        transition=TransitionCosts(checkpoint_save_s=5.0, checkpoint_interval_s=600.0), planning_s=0.5
    )
    scenario = _scenario(small_profile, fail_stops=(FailStop(1000.3, 3), FailStop(2000.0, 0)), costs=costs)
    result = simulate(scenario, SimPolicy.CHECKPOINT, PlannerPool(stub.as_planner()))
    _, kept = cumulative_samples(result)
    assert kept[-1] == pytest.approx(result.samples, rel=1e-9)
    _, averages = windowed_throughput(result, bins=60)
    # Windowed throughput integrates to everything trained, lost work included.
    lost = sum(r.lost_samples for r in result.recoveries)
    assert sum(averages) * 60.0 == pytest.approx(result.samples + lost, rel=1e-9)


def test_checkpoint_policy_saves_at_youngs_interval(stub: StubPlanner, small_profile: ModelProfile) -> None:
    costs = SimCosts(transition=TransitionCosts(checkpoint_save_s=8.0, checkpoint_interval_s=1800.0))
    # 4 nodes at 0.5 failures per node-hour: one failure every 1800 s; Young: sqrt(2 * 8 * 1800) = 169.7 s.
    scenario = _scenario(small_profile, failure_rate_per_node_hour=0.5, costs=costs)
    pool = PlannerPool(stub.as_planner())
    restart = simulate(scenario, SimPolicy.CHECKPOINT, pool)
    others = simulate(scenario, SimPolicy.ADAPTIVE, pool)
    pauses = [start for start, throughput, _ in restart.timeline if throughput == 0.0]
    assert pauses[:2] == pytest.approx([math.sqrt(2 * 8.0 * 1800.0), 2 * math.sqrt(2 * 8.0 * 1800.0)])
    assert [start for start, throughput, _ in others.timeline if throughput == 0.0] == [1800.0]
