"""Fault tolerance is a constraint of every `auto` candidate (issue #14): f + 1 replicas of every layer while
the alive nodes can hold them, a checkpoint restart that costs the work since the checkpoint actually written,
and a dynamic layout at least as fast as any layout another candidate finds on the same nodes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilientjob.planner import (
    ClusterSpec,
    JobSpec,
    LayerProfile,
    ModelProfile,
    PipelinePlan,
    Plan,
    PlannerError,
    Policy,
    StagePlan,
    TransitionCosts,
)
from resilientjob.planner._dynamic import DynamicSearch, all_degrees
from resilientjob.planner.search import (
    AUTO_POLICIES,
    _change,
    _Replanner,
    initial_plan,
    replan,
    replicas,
)
from resilientjob.planner.spec import CheckpointState

GiB = 2**30


def _grid(dp: int, pp: int, layers: int, microbatches: int, step_time_s: float = 1.0) -> Plan:
    per = layers // pp
    return Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        pipelines=tuple(
            PipelinePlan(
                stages=tuple(
                    StagePlan(layers=(s * per, (s + 1) * per if s < pp - 1 else layers), node=p * pp + s)
                    for s in range(pp)
                ),
                microbatches=microbatches,
            )
            for p in range(dp)
        ),
        step_time_s=step_time_s,
    )


def _candidate(plan: Plan, policy: Policy):  # type: ignore[no-untyped-def]
    return next(c for c in plan.candidates if c.policy is policy)


def test_issue_reproducer_keeps_f_plus_1_and_no_checkpoint_restart() -> None:
    # rjob plan --profile bert-large --nodes 6 --global-batch 24 --microbatch-size 1 --ft 2 --failed 1
    profile = ModelProfile.load("bert-large")
    cluster = ClusterSpec(nodes=6)
    job = JobSpec(global_batch=24, microbatch_size=1, fault_tolerance=2)
    start = initial_plan(profile, cluster, job)
    assert len(start.pipelines) == 3
    nothing = CheckpointState(configured=False, step=500)
    plan = replan(start, profile, cluster, job, failed=[1], checkpoint=nothing)
    assert plan.policy in (Policy.DYNAMIC, Policy.TEMPLATES)
    assert replicas(plan, profile.num_layers)[0] >= 3
    reroute = _candidate(plan, Policy.REROUTE)
    assert not reroute.feasible and "keeps 2 replica(s)" in reroute.reason and "can hold 3" in reroute.reason
    checkpoint = _candidate(plan, Policy.CHECKPOINT)
    assert not checkpoint.feasible and "no checkpoint was written" in checkpoint.reason
    # Named, reroute is used as asked, and says what it gives up.
    named = replan(start, profile, cluster, job, failed=[1], policy=Policy.REROUTE, checkpoint=nothing)
    assert named.policy is Policy.REROUTE
    assert "keeps 2 replica(s)" in _candidate(named, Policy.REROUTE).reason


@pytest.mark.parametrize(
    ("state", "lost_steps"),
    [
        (CheckpointState(configured=True, step=1000, last_step=900), 100),
        (CheckpointState(configured=True, step=1000), 1000),  # none written yet: all the work
        (CheckpointState(configured=False, step=1000, last_step=990), 10),  # one was written by hand
    ],
)
def test_checkpoint_costs_the_work_since_the_last_checkpoint(state: CheckpointState, lost_steps: int) -> None:
    profile = ModelProfile.load("bert-large")
    cluster = ClusterSpec(nodes=8)
    job = JobSpec(global_batch=32, microbatch_size=1, fault_tolerance=1)
    costs = TransitionCosts(detection_s=2, checkpoint_load_s=100, checkpoint_interval_s=1800)
    current = _grid(4, 2, profile.num_layers, 8, step_time_s=0.5)
    plan = replan(current, profile, cluster, job, failed=[3], costs=costs, checkpoint=state)
    candidate = _candidate(plan, Policy.CHECKPOINT)
    assert candidate.feasible
    fixed = 2 + 100 + lost_steps * 0.5
    assert fixed <= candidate.transition_s <= fixed + plan.planning_s
    assert f"{lost_steps} steps" in candidate.reason


def test_lost_layers_without_any_checkpoint_cannot_be_planned() -> None:
    profile = ModelProfile.load("bert-large")
    cluster = ClusterSpec(nodes=4)
    job = JobSpec(global_batch=16, microbatch_size=1, fault_tolerance=1)
    current = _grid(2, 2, profile.num_layers, 8)
    with pytest.raises(PlannerError, match="no checkpoint was written"):
        replan(current, profile, cluster, job, failed=[0, 2], checkpoint=CheckpointState(configured=False))
    configured = replan(
        current, profile, cluster, job, failed=[0, 2], checkpoint=CheckpointState(configured=True, step=7)
    )
    assert configured.policy is Policy.CHECKPOINT


def test_too_few_nodes_for_f_plus_1_says_why() -> None:
    # 2 GiB layers (with gradients) on 3 GiB devices: one layer a node, so 6 alive nodes hold one pipeline.
    layer = LayerProfile(
        forward_s=0.01, backward_s=0.02, param_bytes=GiB // 2, optimizer_bytes=GiB, activation_bytes=2**20
    )
    profile = ModelProfile(name="wide", layers=(layer,) * 4)
    cluster = ClusterSpec(nodes=8, device_memory_bytes=3 * GiB)
    job = JobSpec(global_batch=8, microbatch_size=1, fault_tolerance=1)
    start = initial_plan(profile, cluster, job)
    assert len(start.pipelines) == 2
    plan = replan(start, profile, cluster, job, failed=[0, 5], checkpoint=CheckpointState(configured=True))
    dynamic = _candidate(plan, Policy.DYNAMIC)
    assert dynamic.feasible and "cannot hold f + 1 = 2 pipelines" in dynamic.reason


def test_more_nodes_than_the_pipelines_can_use_keep_f_plus_1_without_a_false_why() -> None:
    # 2 micro-batches cap DP at 2 and 4 layers cap a pipeline at 4 nodes: of the 9 alive nodes 8 can work.
    # The search partitioned all 9 (none fits), fell to its "fewer than f + 1 fit" branch and told the user
    # that the 9 nodes "cannot hold f + 1 = 2 pipelines (at most 2)" (found by the property below).
    layer = LayerProfile(
        forward_s=1 / 64, backward_s=1 / 32, param_bytes=2**20, optimizer_bytes=0, activation_bytes=0
    )
    profile = ModelProfile(name="short", layers=(layer,) * 4)
    cluster = ClusterSpec(nodes=10, device_memory_bytes=2 * GiB)
    job = JobSpec(global_batch=2, microbatch_size=1, fault_tolerance=1)
    start = initial_plan(profile, cluster, job)
    plan = replan(start, profile, cluster, job, failed=[0], checkpoint=CheckpointState(configured=True))
    dynamic = _candidate(plan, Policy.DYNAMIC)
    assert dynamic.feasible and "cannot hold" not in dynamic.reason, dynamic.reason
    assert "1 node(s) idle" in dynamic.reason
    assert replicas(plan, profile.num_layers)[0] >= 2
    # The exhaustive reference over every layout of 2 pipelines is not empty either.
    assert DynamicSearch(profile, cluster, job, 9).search(all_degrees(9, job, 2), 9)


# ---- properties --------------------------------------------------------------------------------------------
@st.composite
def _cases(draw: st.DrawFn) -> tuple[ModelProfile, ClusterSpec, JobSpec, list[int], CheckpointState]:
    layers = draw(st.integers(4, 10))
    profile = ModelProfile(
        name="random",
        layers=tuple(
            LayerProfile(
                forward_s=draw(st.floats(0.001, 0.02)),
                backward_s=draw(st.floats(0.002, 0.04)),
                param_bytes=draw(st.integers(2**20, GiB // 4)),
                optimizer_bytes=draw(st.integers(0, GiB // 2)),
                activation_bytes=draw(st.integers(0, GiB // 32)),
            )
            for _ in range(layers)
        ),
    )
    nodes = draw(st.integers(3, 12))
    f = draw(st.integers(1, min(2, nodes - 1)))
    cluster = ClusterSpec(
        nodes=nodes,
        device_memory_bytes=draw(st.sampled_from([2 * GiB, 4 * GiB, 16 * GiB])),
        inter_node_bandwidth=draw(st.sampled_from([1e9, 25e9])),
    )
    microbatches = draw(st.integers(f + 1, 48))
    job = JobSpec(global_batch=microbatches, microbatch_size=1, fault_tolerance=f)
    failed = draw(st.lists(st.integers(0, nodes - 1), min_size=1, max_size=f, unique=True))
    step = draw(st.integers(0, 5000))
    last = draw(st.none() | st.integers(0, step))
    state = CheckpointState(configured=draw(st.booleans()), step=step, last_step=last)
    return profile, cluster, job, failed, state


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases(), st.sampled_from([1e-4, 0.01, 5.0]))
def test_every_auto_candidate_keeps_f_plus_1_when_it_can(
    case: tuple[ModelProfile, ClusterSpec, JobSpec, list[int], CheckpointState], rate: float
) -> None:
    profile, cluster, job, failed, state = case
    try:
        start = initial_plan(profile, cluster, job)
    except PlannerError:
        return  # the model fits nowhere on this cluster: nothing to recover
    f = job.fault_tolerance
    change = _change(start, profile, cluster, failed, ())
    replanner = _Replanner(start, profile, cluster, job, change, TransitionCosts(), state)
    alive = len(change.alive)
    # Independent of the search: f + 1 pipelines of one depth fit when some depth's even split fits memory.
    table = replanner.search.table
    can = any(
        depth * (f + 1) <= alive and table.split(depth) is not None
        for depth in range(1, min(alive, profile.num_layers) + 1)
    )
    options = {policy: replanner.option(policy) for policy in AUTO_POLICIES}
    for policy, option in options.items():
        if option.plan is None:
            continue
        kept = replicas(option.plan, profile.num_layers)[0]
        if can:
            assert kept >= f + 1, (policy, option.plan.layout, option.reason)
        else:
            assert kept >= f + 1 or "cannot hold f + 1" in option.reason, (policy, option.reason)
    dynamic = options[Policy.DYNAMIC].plan
    checkpoint = options[Policy.CHECKPOINT].plan
    if dynamic is not None and checkpoint is not None:
        # The dynamic search covers the checkpoint candidate's layout on the same nodes.
        assert dynamic.step_time_s <= checkpoint.step_time_s * (1 + 1e-9)
    if dynamic is not None and can:
        # ... and is as fast as the exhaustive search over every layout of f + 1 or more pipelines.
        exhaustive = DynamicSearch(profile, cluster, job, alive).search(all_degrees(alive, job, f + 1), alive)
        assert dynamic.step_time_s <= exhaustive[0].step_time_s * (1 + 1e-9)
    try:
        chosen = replan(
            start, profile, cluster, job, failed=failed, checkpoint=state, failure_rate_per_node_hour=rate
        )
    except PlannerError:
        assert all(option.plan is None for option in options.values())
        return
    best = max(c.score for c in chosen.candidates if c.feasible)
    assert _candidate(chosen, chosen.policy).score == best
    dynamic_candidate = _candidate(chosen, Policy.DYNAMIC)
    if dynamic_candidate.feasible:
        assert best >= dynamic_candidate.score
    if can and not change.lost:
        assert replicas(chosen, profile.num_layers)[0] >= f + 1


def test_auto_uses_templates_above_128_nodes_only_once_warmed() -> None:
    from resilientjob.planner import uniform_profile
    from resilientjob.planner.search import TEMPLATES_ON_DEMAND_NODES, prepare_templates

    profile = uniform_profile(4, param_bytes=2**20)
    cluster = ClusterSpec(nodes=TEMPLATES_ON_DEMAND_NODES + 2)
    job = JobSpec(global_batch=264, microbatch_size=1, fault_tolerance=1)
    start = initial_plan(profile, cluster, job)
    cold = replan(start, profile, cluster, job, failed=[5])
    assert "not generated yet" in _candidate(cold, Policy.TEMPLATES).reason
    assert prepare_templates(profile, cluster, job)
    warm = replan(start, profile, cluster, job, failed=[5])
    assert _candidate(warm, Policy.TEMPLATES).feasible
