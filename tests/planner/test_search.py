"""Plan search (Odyssey): the paper's examples, the adaptive choice, and the pieces it is built from."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
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
    allreduce_rounds,
    pipeline_time,
    reroute_step_time,
    uniform_profile,
)
from resilientjob.planner._dynamic import distribute, partitions
from resilientjob.planner._search_shapes import ShapeTable, _makespan_bound, clear_shape_tables, shape_table
from resilientjob.planner.balance import balance_monotone
from resilientjob.planner.restorer import allreduce_rounds_from_bounds, transfer_time
from resilientjob.planner.search import initial_plan, mean_time_between_failures, replan, score, warm_up

MiB = 2**20


def _grid(dp: int, pp: int, layers: int, microbatches: int) -> Plan:
    """DP x PP with equal stages; node p * pp + s runs stage s of pipeline p."""
    per = layers // pp
    return Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        pipelines=tuple(
            PipelinePlan(
                stages=tuple(StagePlan(layers=(s * per, (s + 1) * per), node=p * pp + s) for s in range(pp)),
                microbatches=microbatches,
            )
            for p in range(dp)
        ),
        step_time_s=1.0,
    )


def _custom(pipelines: list[list[tuple[int, int, int]]], microbatches: int) -> Plan:
    """Pipelines given as (start, end, node) stages."""
    return Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        pipelines=tuple(
            PipelinePlan(
                stages=tuple(StagePlan(layers=(a, b), node=n) for a, b, n in stages),
                microbatches=microbatches,
            )
            for stages in pipelines
        ),
        step_time_s=1.0,
    )


def _stage_nodes(plan: Plan) -> list[int]:
    return [stage.node for pipeline in plan.pipelines for stage in pipeline.stages if not stage.rerouted]


def _candidate(plan: Plan, policy: Policy):  # type: ignore[no-untyped-def]
    return next(c for c in plan.candidates if c.policy is policy)


# ---- Odyssey Fig. 3 ----------------------------------------------------------------------------------------
def _fig3_profile() -> ModelProfile:
    """Nine layers: eight equal blocks and a lighter last layer (an LM head costs about half a block, as in
    the llama2-7b profile), so the even split with the remainder at the end is also the fastest."""
    block = uniform_profile(1).layers[0]
    head = block.model_copy(update={"forward_s": block.forward_s / 2, "backward_s": block.backward_s / 2})
    return ModelProfile(name="fig3", layers=(*[block] * 8, head))


def test_odyssey_fig3_dp3_pp3_becomes_dp2_pp4_with_minimal_transfers() -> None:
    profile = _fig3_profile()
    cluster = ClusterSpec(nodes=9)
    job = JobSpec(global_batch=48, microbatch_size=1, fault_tolerance=1, pp_range=(3, 4))
    start = initial_plan(profile, cluster, job)
    assert start.layout == "DP3 PP[3,3,3]"
    assert [s.layers for s in start.pipelines[0].stages] == [(0, 3), (3, 6), (6, 9)]

    failed = start.pipelines[2].stages[2].node
    plan = replan(start, profile, cluster, job, failed=[failed], policy=Policy.DYNAMIC)
    assert plan.policy is Policy.DYNAMIC
    assert plan.layout == "DP2 PP[4,4]"
    for pipeline in plan.pipelines:
        assert [stage.num_layers for stage in pipeline.stages] == [2, 2, 2, 3]
    alive = sorted(set(range(9)) - {failed})
    assert sorted(_stage_nodes(plan)) == alive  # every alive node runs exactly one stage
    assert plan.global_batch == 48

    # The transfers equal the brute-force minimum over every assignment of alive nodes to the new slots.
    holdings = start.layers_by_node()
    slots = [set(range(*stage.layers)) for pipeline in plan.pipelines for stage in pipeline.stages]
    size = profile.layers[0].state_bytes
    best = min(
        sum(len(slot - holdings[node]) for slot, node in zip(slots, order, strict=True))
        for order in itertools.permutations(alive)
    )
    assert plan.transfer_bytes() == best * size
    for transfer in plan.transfers:
        assert transfer.layer in holdings[transfer.src]
        assert transfer.src != failed


# ---- data rerouting ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("failed", "per_stage"),
    [
        ([4], [0, 1, 0]),  # one failure: eq. 12
        ([1, 4], [0, 2, 0]),  # two replicas of one stage: eq. 13
        ([0, 5, 7], [1, 1, 1]),  # one failure in every stage, different pipelines: eq. 13
    ],
)
def test_reroute_step_time_is_eq12_13_on_symmetric_layouts(failed: list[int], per_stage: list[int]) -> None:
    # Parameters carry no bytes, so the gradient all-reduce is free and the step is eq. 13 alone.
    profile = uniform_profile(9, param_bytes=0)
    cluster = ClusterSpec(nodes=9)
    job = JobSpec(global_batch=48, microbatch_size=1, fault_tolerance=2)
    current = _grid(3, 3, 9, 16)
    plan = replan(current, profile, cluster, job, failed=failed, policy=Policy.REROUTE)
    assert plan.policy is Policy.REROUTE
    forward, backward = profile.stage_times(0, 3)
    expected = reroute_step_time(3, 16, 3, per_stage, forward, backward)
    assert plan.step_time_s == pytest.approx(expected, rel=1e-12)
    assert plan.transfers == ()
    for pipeline in plan.pipelines:
        for index, stage in enumerate(pipeline.stages):
            if stage.node in failed:
                peers = {p.stages[index].node for p in plan.pipelines} - set(failed)
                assert stage.rerouted_to == tuple(sorted(peers))
            else:
                assert not stage.rerouted


def test_reroute_on_asymmetric_layout_charges_every_failed_stage() -> None:
    profile = uniform_profile(8, param_bytes=0)
    cluster = ClusterSpec(nodes=7)
    job = JobSpec(global_batch=30, microbatch_size=1)
    current = _custom([[(0, 4, 0), (4, 8, 1)], [(0, 6, 2), (6, 8, 3)], [(0, 3, 4), (3, 5, 5), (5, 8, 6)]], 10)
    healthy = replan(current, profile, cluster, job, policy=Policy.REROUTE)
    one = replan(current, profile, cluster, job, failed=[1], policy=Policy.REROUTE)
    two = replan(current, profile, cluster, job, failed=[1, 4], policy=Policy.REROUTE)
    # Layers 4..7 of pipeline 0 run on the two other pipelines: 5 micro-batches each.
    assert one.pipelines[0].stages[1].rerouted_to == (2, 3, 5, 6)
    work = max(
        sum(profile.stage_times(4, 6)) + sum(profile.stage_times(6, 8)), sum(profile.stage_times(4, 8))
    )
    assert one.step_time_s == pytest.approx(healthy.step_time_s + 5 * work)
    assert two.step_time_s > one.step_time_s


def test_reroute_infeasible_without_an_intact_peer_so_auto_picks_dynamic() -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=7)
    job = JobSpec(global_batch=30, microbatch_size=1)
    current = _custom([[(0, 4, 0), (4, 8, 1)], [(0, 6, 2), (6, 8, 3)], [(0, 3, 4), (3, 5, 5), (5, 8, 6)]], 10)
    # Every layer survives somewhere, but no pipeline holds layers 4..7 on live nodes only.
    plan = replan(current, profile, cluster, job, failed=[1, 3, 5])
    reroute = _candidate(plan, Policy.REROUTE)
    assert not reroute.feasible and "4..7" in reroute.reason
    assert plan.policy is Policy.DYNAMIC
    assert sorted(_stage_nodes(plan)) == [0, 2, 4, 6]


def test_a_node_whose_copy_is_in_doubt_holds_nothing_it_was_given() -> None:
    """`emptied`: a replacement whose copy may have been cut short runs on, but its layers are not counted:
    with its replica's last holder failed, the job goes to the checkpoint instead of a plan that needed the
    layers from it; with another holder alive, the layers are copied to it again, and reroute is refused."""
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=2)
    job = JobSpec(global_batch=16, microbatch_size=1, fault_tolerance=1)
    current = _grid(2, 1, 8, 8)  # nodes 0 and 1 each hold every layer
    trusted = replan(current, profile, cluster, job, failed=[0])
    assert trusted.policy is not Policy.CHECKPOINT and trusted.nodes == (1,)
    doubted = replan(current, profile, cluster, job, failed=[0], emptied=[1])
    assert doubted.policy is Policy.CHECKPOINT and doubted.nodes == (1,)
    kept = replan(_grid(3, 1, 8, 8), profile, ClusterSpec(nodes=3), job, failed=[0], emptied=[1])
    assert kept.policy is not Policy.REROUTE and 1 in kept.nodes
    assert {t.dst for t in kept.transfers} == {1} and {t.src for t in kept.transfers} == {2}
    assert "may not hold the layers" in _candidate(kept, Policy.REROUTE).reason


def test_templates_copy_again_to_a_node_whose_copy_is_in_doubt() -> None:
    """Reinstantiated templates honour `emptied` too: the node's pipeline is rebuilt, its layers are copied
    to it again from another replica, and it is no copy's source (it kept its stage and got nothing)."""
    profile = uniform_profile(4)
    cluster = ClusterSpec(nodes=4)
    job = JobSpec(global_batch=12, microbatch_size=1, fault_tolerance=1)
    current = initial_plan(profile, cluster, job, policy=Policy.TEMPLATES)
    plan = replan(current, profile, cluster, job, failed=[0], emptied=[3], policy=Policy.TEMPLATES)
    assert plan.policy is Policy.TEMPLATES and 3 in plan.nodes
    held = plan.layers_by_node()[3]
    assert {t.layer for t in plan.transfers if t.dst == 3} == held
    assert all(t.src != 3 for t in plan.transfers)


def test_a_first_plan_leaves_nodes_idle_when_no_layout_of_them_all_fits() -> None:
    """Five nodes, four layers, and memory that rules out sharing a stage's layers between fewer than four
    nodes: no layout uses all five, and the job runs DP1 PP4 with one node idle (it failed to start, the
    error blaming `fault_tolerance`)."""
    plan = initial_plan(
        uniform_profile(4),
        ClusterSpec(nodes=5, device_memory_bytes=600 * 2**20),
        JobSpec(global_batch=8, microbatch_size=1, fault_tolerance=0),
    )
    assert plan.layout == "DP1 PP[4]" and plan.nodes == (0, 1, 2, 3)
    # A failure: the idle node is planned on only when it is said to run (the operator lists the ready
    # ones as joined; a pod still Pending or gone is no node to wait for).
    profile, job = uniform_profile(4), JobSpec(global_batch=8, microbatch_size=1, fault_tolerance=0)
    cluster = ClusterSpec(nodes=5, device_memory_bytes=600 * 2**20)
    assert 4 in replan(plan, profile, cluster, job, failed=[1]).nodes  # the simulator's view: alive
    with pytest.raises(PlannerError, match="3 alive nodes"):  # the model needs four
        replan(plan, profile, cluster, job, failed=[1], standby=())
    assert 4 in replan(plan, profile, cluster, job, failed=[1], joined=[4], standby=()).nodes


def test_a_joined_node_that_cannot_make_a_pipeline_stays_idle_under_templates() -> None:
    """Every pipeline at the largest template and one node joins: splitting one would leave a pipeline below
    the smallest template (templates were infeasible, and `policy: templates` restarted from a checkpoint)."""
    profile = uniform_profile(4)
    cluster = ClusterSpec(nodes=4, device_memory_bytes=1200 * 2**20)
    job = JobSpec(global_batch=12, microbatch_size=1, fault_tolerance=1)
    current = initial_plan(profile, cluster, job, policy=Policy.TEMPLATES)
    plan = replan(current, profile, cluster, job, joined=[4], policy=Policy.TEMPLATES)
    assert plan.policy is Policy.TEMPLATES and 4 not in plan.nodes and not plan.transfers


def test_a_profile_without_any_work_is_refused_naming_the_field() -> None:
    layer = {"forward_s": 0, "backward_s": 0, "param_bytes": 1, "optimizer_bytes": 1, "activation_bytes": 1}
    with pytest.raises(PlannerError, match=r"^profile\.layers: every layer takes 0 s"):
        ModelProfile.from_mapping({"layers": [layer, layer]})


def test_stage_that_lost_every_replica_goes_to_checkpoint() -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=4)
    job = JobSpec(global_batch=16, microbatch_size=1, fault_tolerance=1)
    current = _grid(2, 2, 8, 8)
    # Two failures (more than f = 1), both on stage 0: layers 0..3 are gone everywhere.
    plan = replan(current, profile, cluster, job, failed=[0, 2])
    assert plan.policy is Policy.CHECKPOINT
    assert [c.policy for c in plan.candidates] == [
        Policy.REROUTE,
        Policy.DYNAMIC,
        Policy.TEMPLATES,
        Policy.CHECKPOINT,
    ]
    for policy in (Policy.REROUTE, Policy.DYNAMIC, Policy.TEMPLATES):
        candidate = _candidate(plan, policy)
        assert not candidate.feasible
        assert "no surviving replica" in candidate.reason
    assert set(plan.nodes) <= {1, 3}
    assert plan.failed_nodes == (0, 2)
    # A named policy that cannot run falls back to the checkpoint, saying why.
    forced = replan(current, profile, cluster, job, failed=[0, 2], policy=Policy.REROUTE)
    assert forced.policy is Policy.CHECKPOINT
    assert [c.policy for c in forced.candidates] == [Policy.REROUTE, Policy.CHECKPOINT]
    assert not forced.candidates[0].feasible
    templates = replan(current, profile, cluster, job, failed=[0, 2], policy=Policy.TEMPLATES)
    assert templates.policy is Policy.CHECKPOINT
    assert "no surviving replica" in templates.candidates[0].reason


def test_templates_policy_instantiates_then_reinstantiates() -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=6)
    job = JobSpec(global_batch=24, microbatch_size=1, fault_tolerance=1)
    start = initial_plan(profile, cluster, job, policy=Policy.TEMPLATES)
    assert start.policy is Policy.TEMPLATES and start.generation == 0
    assert sorted(_stage_nodes(start)) == list(range(6))
    plan = replan(start, profile, cluster, job, failed=[4], policy=Policy.TEMPLATES)
    assert plan.policy is Policy.TEMPLATES and plan.generation == 1
    assert sorted(_stage_nodes(plan)) == [0, 1, 2, 3, 5]
    assert plan.global_batch == 24
    candidate = _candidate(plan, Policy.TEMPLATES)
    assert candidate.transition_s >= TransitionCosts().restart_s
    # From a dynamic plan the templates are instantiated afresh and placed with the fewest bytes moved.
    dynamic_start = initial_plan(profile, cluster, job)
    moved = replan(dynamic_start, profile, cluster, job, failed=[4], policy=Policy.TEMPLATES)
    assert moved.policy is Policy.TEMPLATES
    assert sorted(_stage_nodes(moved)) == [0, 1, 2, 3, 5]
    assert all(t.src != 4 for t in moved.transfers)


# ---- the adaptive choice -----------------------------------------------------------------------------------
def test_failure_rate_alone_flips_auto_between_reroute_and_dynamic() -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=8)
    job = JobSpec(global_batch=64, microbatch_size=1, fault_tolerance=1)
    current = _grid(4, 2, 8, 16)
    rare = replan(current, profile, cluster, job, failed=[3], failure_rate_per_node_hour=1e-4)
    frequent = replan(current, profile, cluster, job, failed=[3], failure_rate_per_node_hour=50.0)
    assert rare.policy is Policy.DYNAMIC
    assert frequent.policy is Policy.REROUTE
    # Same candidates, same estimates: only the effective-time ratio changed.
    for a, b in zip(rare.candidates, frequent.candidates, strict=True):
        assert (a.policy, a.layout, a.feasible) == (b.policy, b.layout, b.feasible)
        assert a.step_time_s == pytest.approx(b.step_time_s)
    dynamic, reroute = _candidate(rare, Policy.DYNAMIC), _candidate(rare, Policy.REROUTE)
    assert dynamic.step_time_s < reroute.step_time_s
    assert dynamic.transition_s > reroute.transition_s


def test_transition_times_add_up() -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=8, inter_node_bandwidth=1e9)
    job = JobSpec(global_batch=64, microbatch_size=1, fault_tolerance=1)
    costs = TransitionCosts(restart_s=40, detection_s=3, checkpoint_load_s=500, checkpoint_interval_s=1000)
    current = _grid(4, 2, 8, 16)
    plan = replan(current, profile, cluster, job, failed=[3], costs=costs)
    planning = plan.planning_s
    reroute = _candidate(plan, Policy.REROUTE)
    assert 3 <= reroute.transition_s <= 3 + planning
    dynamic_plan = replan(current, profile, cluster, job, failed=[3], costs=costs, policy=Policy.DYNAMIC)
    copy = transfer_time(dynamic_plan.transfers, cluster.inter_node_bandwidth)
    assert copy > 0
    assert 43 + copy <= dynamic_plan.transition_s <= 43 + copy + dynamic_plan.planning_s
    checkpoint = _candidate(plan, Policy.CHECKPOINT)
    assert 3 + 500 + 500 <= checkpoint.transition_s <= 1003 + planning
    between = mean_time_between_failures(0.01, 7)  # the default rate over the 7 alive nodes
    for candidate in plan.candidates:
        if candidate.feasible:
            assert candidate.score == pytest.approx(
                score(64, candidate.step_time_s, candidate.transition_s, between)
            )


def test_a_fixed_search_time_makes_the_choice_reproducible() -> None:
    """Measured, the search time told apart two candidates of one layout by a millisecond, whichever the host
    ran faster (`rjob simulate --planning-s` gave two results in CI). `TransitionCosts.search_s` fixes it."""
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=8, inter_node_bandwidth=1e9)
    job = JobSpec(global_batch=64, microbatch_size=1, fault_tolerance=1)
    costs = TransitionCosts(restart_s=40, detection_s=3, checkpoint_load_s=500, search_s=0.25)
    current = _grid(4, 2, 8, 16)
    plans = [replan(current, profile, cluster, job, failed=[3], costs=costs) for _ in range(2)]
    assert plans[0].candidates == plans[1].candidates
    assert plans[0].policy == plans[1].policy
    reroute = _candidate(plans[0], Policy.REROUTE)
    assert reroute.transition_s == 3 + 0.25  # no restart, no copy: detection and the fixed search alone


def test_score_is_eq8() -> None:
    assert score(100, 2.0, 10.0, math.inf) == 50.0
    assert score(100, 2.0, 10.0, 40.0) == pytest.approx(50.0 * 30 / 40)
    assert score(100, 2.0, 50.0, 40.0) == 0.0
    assert mean_time_between_failures(0.5, 4) == pytest.approx(1800.0)
    assert math.isinf(mean_time_between_failures(0.0, 4))


# ---- memory ------------------------------------------------------------------------------------------------
def _heavy_tail_profile() -> ModelProfile:
    light = LayerProfile(
        forward_s=0.01,
        backward_s=0.02,
        param_bytes=100 * MiB,
        optimizer_bytes=200 * MiB,
        activation_bytes=200 * MiB,
    )
    heavy = light.model_copy(update={"forward_s": 0.03, "backward_s": 0.06})
    return ModelProfile(layers=(light, light, light, light, heavy))


def test_memory_filter_rejects_oom_splits() -> None:
    profile = _heavy_tail_profile()
    roomy = ShapeTable(profile, ClusterSpec(nodes=2, device_memory_bytes=80 * 2**30), 8)
    split = roomy.split(2)
    assert split is not None and split.layer_counts == [3, 2]  # faster: the heavy layer shares less
    # Stage 0 holds two micro-batches in flight: [3, 2] needs 2400 MiB there, [2, 3] at most 1800 MiB.
    tight = ShapeTable(profile, ClusterSpec(nodes=2, device_memory_bytes=2000 * MiB), 8)
    split = tight.split(2)
    assert split is not None and split.layer_counts == [2, 3]
    assert split.peak_memory_bytes <= 2000 * MiB
    too_small = ShapeTable(profile, ClusterSpec(nodes=2, device_memory_bytes=1500 * MiB), 8)
    assert too_small.split(2) is None


def test_plans_respect_device_memory_and_fail_clearly_when_nothing_fits() -> None:
    profile = _heavy_tail_profile()
    job = JobSpec(global_batch=16, microbatch_size=1, fault_tolerance=1)
    cluster = ClusterSpec(nodes=4, device_memory_bytes=2000 * MiB)
    plan = initial_plan(profile, cluster, job)
    assert plan.peak_memory_bytes <= 2000 * MiB
    assert len(plan.pipelines) >= 2
    with pytest.raises(PlannerError) as info:
        initial_plan(profile, ClusterSpec(nodes=4, device_memory_bytes=500 * MiB), job)
    assert info.value.field == "device_memory_bytes"


# ---- joins, generations, validation ------------------------------------------------------------------------
def test_joined_nodes_are_used() -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=4)
    job = JobSpec(global_batch=32, microbatch_size=1, fault_tolerance=1)
    start = initial_plan(profile, cluster, job)
    grown = replan(start, profile, cluster, job, joined=[4], policy=Policy.DYNAMIC)
    assert 4 in grown.nodes and sorted(_stage_nodes(grown)) == [0, 1, 2, 3, 4]
    assert any(t.dst == 4 for t in grown.transfers)
    swapped = replan(start, profile, cluster, job, failed=[1], joined=[4])
    assert "joined nodes idle" in _candidate(swapped, Policy.REROUTE).reason
    dynamic = _candidate(swapped, Policy.DYNAMIC)
    assert dynamic.feasible
    if swapped.policy is Policy.DYNAMIC:
        assert 4 in swapped.nodes


def test_generations_and_failures_accumulate() -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=8)
    job = JobSpec(global_batch=64, microbatch_size=1, fault_tolerance=2)
    start = initial_plan(profile, cluster, job)
    assert start.generation == 0 and start.nodes == tuple(range(8))
    first = replan(start, profile, cluster, job, failed=[2], policy=Policy.REROUTE)
    second = replan(first, profile, cluster, job, failed=[5], policy=Policy.DYNAMIC)
    assert (first.generation, second.generation) == (1, 2)
    assert second.failed_nodes == (2, 5)
    assert sorted(_stage_nodes(second)) == [0, 1, 3, 4, 6, 7]
    # A node that comes back has lost its state: rerouting keeps its old stage on the peers.
    rejoined = replan(first, profile, cluster, job, joined=[2], policy=Policy.REROUTE)
    assert rejoined.failed_nodes == ()
    assert [s.node for p in rejoined.pipelines for s in p.stages if s.rerouted] == [2]
    back = replan(second, profile, cluster, job, joined=[2], policy=Policy.DYNAMIC)
    assert back.failed_nodes == (5,) and 2 in back.nodes
    for plan in (start, first, second, back):
        assert plan.global_batch == 64
        assert plan.policy is not Policy.AUTO


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"failed": [9]}, "failed"),
        ({"failed": [1, 1, 2], "joined": [2]}, "joined"),
        ({"joined": [0]}, "joined"),
        ({"failure_rate_per_node_hour": -1.0}, "failure_rate_per_node_hour"),
        ({"failure_rate_per_node_hour": math.nan}, "failure_rate_per_node_hour"),
        ({"failed": [0, 1, 2, 3]}, "failed"),
    ],
)
def test_impossible_requests_name_the_field(kwargs: dict[str, object], field: str) -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=4)
    job = JobSpec(global_batch=16, microbatch_size=1, fault_tolerance=1)
    start = initial_plan(profile, cluster, job)
    with pytest.raises(PlannerError) as info:
        replan(start, profile, cluster, job, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_already_failed_node_and_layer_mismatch_are_rejected() -> None:
    profile = uniform_profile(8)
    cluster = ClusterSpec(nodes=4)
    job = JobSpec(global_batch=16, microbatch_size=1, fault_tolerance=1)
    first = replan(initial_plan(profile, cluster, job), profile, cluster, job, failed=[1])
    with pytest.raises(PlannerError, match="already failed"):
        replan(first, profile, cluster, job, failed=[1])
    with pytest.raises(PlannerError) as info:
        replan(first, uniform_profile(6), cluster, job, failed=[2])
    assert info.value.field == "profile"


def test_initial_plan_uses_every_node_with_f_plus_one_pipelines() -> None:
    profile = uniform_profile(12)
    for nodes, f in ((5, 1), (7, 2), (12, 0)):
        job = JobSpec(global_batch=60, microbatch_size=2, fault_tolerance=f)
        plan = initial_plan(profile, ClusterSpec(nodes=nodes), job)
        assert sorted(_stage_nodes(plan)) == list(range(nodes))
        assert len(plan.pipelines) >= f + 1
        assert plan.global_batch == 60
        assert plan.candidates and plan.candidates[0].layout == plan.layout
    with pytest.raises(PlannerError) as info:
        initial_plan(
            profile, ClusterSpec(nodes=3), JobSpec(global_batch=8, microbatch_size=1, fault_tolerance=3)
        )
    assert info.value.field == "fault_tolerance"


def test_symmetric_initial_plan_for_reroute_and_checkpoint() -> None:
    profile = uniform_profile(12)
    job = JobSpec(global_batch=48, microbatch_size=1, fault_tolerance=1)
    for policy in (Policy.REROUTE, Policy.CHECKPOINT):
        plan = initial_plan(profile, ClusterSpec(nodes=8), job, policy=policy)
        assert len({len(p.stages) for p in plan.pipelines}) == 1
        assert len({tuple(s.layers for s in p.stages) for p in plan.pipelines}) == 1


# ---- building blocks ---------------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.data())
def test_distribute_equals_the_exact_greedy(data: st.DataObject) -> None:
    classes = data.draw(st.integers(1, 3))
    counts = [data.draw(st.integers(1, 3)) for _ in range(classes)]
    total = data.draw(st.integers(sum(counts), 40))
    # Monotone costs of 1F1B shape: fill, then a per-micro-batch rate, with a bump.
    fills = [data.draw(st.floats(0, 5)) for _ in range(classes)]
    rates = [data.draw(st.floats(0.1, 3)) for _ in range(classes)]

    def cost(c: int, m: int) -> float:
        return fills[c] + rates[c] * m + (0.5 if m > 7 else 0.0)

    start = [data.draw(st.integers(-2, 30)) for _ in range(classes)]
    base, extra, makespan = distribute(counts, total, cost, start=start)
    groups = [c for c in range(classes) for _ in range(counts[c])]
    greedy = balance_monotone(lambda i, m: cost(groups[i], m), len(groups), total)
    assert makespan == pytest.approx(max(cost(groups[i], m) for i, m in enumerate(greedy)))
    assert sum(b * n + e for b, n, e in zip(base, counts, extra, strict=True)) == total
    assert all(0 <= e < n for e, n in zip(extra, counts, strict=True))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_makespan_bound_never_exceeds_the_simulation(data: st.DataObject) -> None:
    import numpy as np

    stages = data.draw(st.integers(1, 6))
    microbatches = data.draw(st.integers(1, 12))
    times = st.floats(0.01, 3)
    forward = [data.draw(times) for _ in range(stages)]
    backward = [data.draw(times) for _ in range(stages)]
    sends = [data.draw(st.floats(0, 1)) for _ in range(stages - 1)]
    bound = _makespan_bound(
        np.array([forward]), np.array([backward]), np.array([sends]).reshape(1, -1), microbatches
    )
    assert bound[0] <= pipeline_time(forward, backward, microbatches, sends) * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rounds_from_bounds_equal_rounds_of_the_pipelines(data: st.DataObject) -> None:
    layers = data.draw(st.integers(2, 10))
    shapes = []
    for _ in range(data.draw(st.integers(2, 4))):
        cuts = sorted(data.draw(st.sets(st.integers(1, layers - 1), max_size=layers - 1)))
        shapes.append((0, *cuts, layers))
    node = itertools.count()
    pipelines = [
        PipelinePlan(
            stages=tuple(StagePlan(layers=(a, b), node=next(node)) for a, b in itertools.pairwise(shape)),
            microbatches=1,
        )
        for shape in shapes
    ]
    assert allreduce_rounds_from_bounds(shapes) == allreduce_rounds(pipelines)


def test_partitions_are_distinct_multisets_within_spread() -> None:
    found = list(partitions(11, 3, lambda depth: True, 2))
    as_lists = [sorted(d for d, c in shape for _ in range(c)) for shape in found]
    assert sorted(as_lists) == [[3, 3, 5], [3, 4, 4]]
    assert len(as_lists) == len({tuple(x) for x in as_lists})
    assert list(partitions(11, 3, lambda depth: depth != 4, 1)) == []
    assert sorted(sorted(d for d, c in s for _ in range(c)) for s in partitions(6, 2, lambda d: True, 2)) == [
        [2, 4],
        [3, 3],
    ]


def test_transfer_time_is_bounded_by_the_busiest_node() -> None:
    from resilientjob.planner import Transfer

    transfers = [
        Transfer(layer=0, src=0, dst=2, bytes=100),
        Transfer(layer=1, src=0, dst=3, bytes=100),
        Transfer(layer=2, src=1, dst=2, bytes=50),
    ]
    assert transfer_time(transfers, 10.0) == pytest.approx(20.0)  # node 0 sends 200 bytes
    assert transfer_time([], 10.0) == 0.0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_incremental_1f1b_equals_the_simulation(data: st.DataObject) -> None:
    from resilientjob.planner.estimator import OneFOneB

    stages = data.draw(st.integers(1, 7))
    times = st.floats(0.01, 3)
    forward = [data.draw(times) for _ in range(stages)]
    backward = [data.draw(times) for _ in range(stages)]
    sends = [data.draw(st.floats(0, 1)) for _ in range(stages - 1)]
    engine = OneFOneB(forward, backward, sends)
    for microbatches in data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=6)):
        assert engine.time(microbatches) == pipeline_time(forward, backward, microbatches, sends)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_bound_lines_stay_below_the_bound(data: st.DataObject) -> None:
    import numpy as np

    from resilientjob.planner._search_shapes import _bound_lines

    stages = data.draw(st.integers(1, 6))
    times = st.floats(0.01, 3)
    forward = np.array([data.draw(times) for _ in range(stages)])
    backward = np.array([data.draw(times) for _ in range(stages)])
    sends = np.array([data.draw(st.floats(0, 1)) for _ in range(stages - 1)])
    intercepts, slopes = _bound_lines(forward, backward, sends)
    for microbatches in range(stages, stages + 8):
        line = float(np.max(intercepts + microbatches * slopes))
        exact = _makespan_bound(forward[None], backward[None], sends[None], microbatches)[0]
        assert line <= exact * (1 + 1e-12)


def test_warm_up_fills_the_tables_a_replan_uses() -> None:
    profile = uniform_profile(12)
    cluster = ClusterSpec(nodes=6)
    job = JobSpec(global_batch=24, microbatch_size=1, fault_tolerance=1)
    start = initial_plan(profile, cluster, job)
    clear_shape_tables()
    assert warm_up(profile, cluster, job) == 6  # every depth 1..6 fits in 80 GiB
    table = shape_table(profile, cluster, job.num_microbatches)
    filled = dict(table._splits)
    assert sorted(filled) == [1, 2, 3, 4, 5, 6]
    replan(start, profile, cluster, job, failed=[2])
    assert table._splits == filled  # the replan found every split it needed ready
