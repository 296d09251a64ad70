"""Real worker processes on gloo: heterogeneous training, live recovery, layer copy and checkpoint fallback.

Each test runs a job through the launcher (torch elastic process contexts, one per node), kills nodes with
`fail_at={node: step}` (the worker exits abruptly at the start of that step, like a crash), and compares with
the failure-free single-process run of the same seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from resilientjob.agent.data import SampleOrder
from resilientjob.agent.models import load_model
from resilientjob.agent.profiler import measure_profile
from resilientjob.agent.runtime import wait_bound_s
from resilientjob.agent.worker import JobConfig
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.planner.profile import ModelProfile, uniform_profile
from resilientjob.testing.faults import StallAt
from resilientjob.testing.launcher import JobResult, Launcher, WorldStopped
from resilientjob.testing.plans import RuntimePlanner
from resilientjob.testing.reference import reference_run

pytestmark = pytest.mark.torch


def _assert_matches_reference(result: JobResult, reference: list[float], steps: int) -> None:
    assert sorted(result.losses) == list(range(steps))
    for step in range(steps):
        assert result.losses[step] == pytest.approx(reference[step], rel=0.01), step


def _assert_each_sample_once(result: JobResult, plan: Plan, steps: int) -> None:
    order = SampleOrder(128, plan.global_batch, seed=0)
    for step in range(steps):
        assert sorted(result.samples[step]) == sorted(order.step_ids(step)), step


def _assert_bytes_equal_transfer_plan(result: JobResult) -> None:
    for plan in result.plans:
        moved = sorted(result.received[plan.generation])
        planned = sorted((t.layer, t.src, t.dst, t.bytes) for t in plan.transfers)
        assert moved == planned, plan.generation


def test_heterogeneous_update_equals_the_symmetric_one(
    tmp_path: Path, job_config: Callable[..., JobConfig]
) -> None:
    # Replica A: 2 stages, 3 micro-batches; replica B: 1 stage, 1 micro-batch. Stage boundaries differ.
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=(
            PipelinePlan(
                stages=(StagePlan(layers=(0, 3), node=0), StagePlan(layers=(3, 8), node=1)), microbatches=3
            ),
            PipelinePlan(stages=(StagePlan(layers=(0, 8), node=2),), microbatches=1),
        ),
    )
    config = job_config(steps=3, return_state=True)
    reference, params, grads = reference_run(config, plan.global_batch, plan.microbatch_size)
    planner = RuntimePlanner.for_job(uniform_profile(8), nodes=3, global_batch=8, microbatch_size=2)
    result = Launcher(config, plan, planner, tmp_path).run(timeout_s=90)
    _assert_matches_reference(result, reference, 3)
    for node, value in result.return_values.items():
        # The summed gradient is the symmetric one up to float summation order...
        for layer, tensors in value["first_grads"].items():
            for got, want in zip(tensors, grads[layer], strict=True):
                torch.testing.assert_close(
                    got, want, rtol=1e-4, atol=1e-7, msg=f"grad node {node} layer {layer}"
                )
        # ...and Adam turns it into the same weights; its g / sqrt(v) normalisation can amplify rounding on
        # near-zero gradients to a fraction of the learning rate, hence the looser weight tolerance.
        for layer, tensors in value["params"].items():
            for got, want in zip(tensors, params[layer], strict=True):
                torch.testing.assert_close(
                    got, want, rtol=0, atol=config.workload.training.lr, msg=f"node {node} layer {layer}"
                )
    assert {layer for v in result.return_values.values() for layer in v["params"]} == set(range(8))


def _two_pipelines(size: int, counts: tuple[int, int]) -> Plan:
    """Two 2-stage pipelines of 8 layers (nodes 0-1 and 2-3) running `counts` micro-batches of `size`."""
    return Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=size,
        step_time_s=1.0,
        pipelines=tuple(
            PipelinePlan(
                stages=(StagePlan(layers=(0, 4), node=2 * i), StagePlan(layers=(4, 8), node=2 * i + 1)),
                microbatches=count,
            )
            for i, count in enumerate(counts)
        ),
    )


def test_finer_micro_batches_published_mid_run_keep_the_update_and_each_sample_once(
    tmp_path: Path, job_config: Callable[..., JobConfig]
) -> None:
    # What fail-slow S2 publishes when whole micro-batches are too coarse to balance a slow pipeline: the
    # same stages, micro-batches of 1 instead of 2, 6 of them on one pipeline and 2 on the other. The loss is
    # the sum of per-sample losses over the global batch, so the update must not change.
    healthy, finer = _two_pipelines(2, (2, 2)), _two_pipelines(1, (6, 2))
    steps = 6
    config = job_config(steps=steps)
    reference, _, _ = reference_run(config, healthy.global_batch, healthy.microbatch_size)
    planner = RuntimePlanner.for_job(uniform_profile(8), nodes=4, global_batch=8, microbatch_size=2)
    result = Launcher(config, healthy, planner, tmp_path, publish_at={1: finer}).run(timeout_s=90)
    assert [p.microbatch_size for p in result.plans] == [2, 1]
    assert len(result.step_times.get(1, [])) >= 2, result.step_times  # steps ran in the finer layout
    _assert_matches_reference(result, reference, steps)
    _assert_each_sample_once(result, healthy, steps)


def test_a_drained_replica_and_its_restore_keep_the_update_and_each_sample_once(
    tmp_path: Path, job_config: Callable[..., JobConfig]
) -> None:
    # What S2 publishes for a replica so slow that its one micro-batch would set the job's pace: none for
    # it, all four on the other; then the restore. The drained nodes run no op, sum zero gradients into the
    # replicas' (so their weights stay current and the restore copies nothing) and count no sample.
    healthy, drained = _two_pipelines(2, (2, 2)), _two_pipelines(2, (4, 0))
    assert drained.idle_nodes == (2, 3)
    steps = 7
    config = job_config(steps=steps, return_state=True)
    reference, params, _ = reference_run(config, healthy.global_batch, healthy.microbatch_size)
    planner = RuntimePlanner.for_job(uniform_profile(8), nodes=4, global_batch=8, microbatch_size=2)
    result = Launcher(config, healthy, planner, tmp_path, publish_at={1: drained, 4: healthy}).run(
        timeout_s=90
    )
    assert [[p.microbatches for p in plan.pipelines] for plan in result.plans] == [[2, 2], [4, 0], [2, 2]]
    assert len(result.step_times.get(1, [])) >= 2, result.step_times  # steps ran drained
    _assert_matches_reference(result, reference, steps)
    _assert_each_sample_once(result, healthy, steps)
    assert all(not result.received[plan.generation] for plan in result.plans[1:])  # nothing copied
    for node, value in result.return_values.items():
        for layer, tensors in value["params"].items():
            for got, want in zip(tensors, params[layer], strict=True):
                torch.testing.assert_close(
                    got, want, rtol=0, atol=config.workload.training.lr, msg=f"node {node} layer {layer}"
                )


def test_kill_one_of_eight_continues_on_seven(
    tmp_path: Path, gpt_profile: ModelProfile, job_config: Callable[..., JobConfig]
) -> None:
    steps = 7
    planner = RuntimePlanner.for_job(
        gpt_profile, nodes=8, global_batch=16, microbatch_size=2, dp_range=(2, 2)
    )
    plan = planner.initial()
    assert plan.layout == "DP2 PP[4,4]"
    config = job_config(steps=steps)
    reference, _, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    result = Launcher(config, plan, planner, tmp_path, fail_at={5: 3}).run(timeout_s=120)
    # `auto`: the planner scored every policy and chose the new layout over rerouting.
    recovered = result.plans[1]
    assert recovered.policy == max(recovered.candidates, key=lambda c: c.score).policy == Policy.DYNAMIC
    # Over the seven alive nodes, or six of them when the symmetric layout is estimated faster (the dynamic
    # search weighs the checkpoint candidate's layouts too, issue #14).
    assert result.plans[0].layout == "DP2 PP[4,4]"
    assert result.plans[1].layout in ("DP2 PP[4,3]", "DP2 PP[3,3]")
    assert result.recoveries[0].failed == (5,) and not result.recoveries[0].restarted
    assert result.recoveries[0].committed_before == 3
    _assert_matches_reference(result, reference, steps)
    _assert_each_sample_once(result, plan, steps)
    _assert_bytes_equal_transfer_plan(result)
    assert result.plans[1].transfer_bytes() > 0


def test_two_simultaneous_failures_reroute_then_dynamic(
    tmp_path: Path, gpt_profile: ModelProfile, job_config: Callable[..., JobConfig]
) -> None:
    steps = 8
    # f = 2: three pipelines of different depths, DP3 PP[3,3,2].
    planner = RuntimePlanner.for_job(
        gpt_profile, nodes=8, global_batch=16, microbatch_size=2, fault_tolerance=2, dp_range=(3, 3)
    )
    plan = planner.initial(Policy.DYNAMIC)
    assert plan.layout == "DP3 PP[3,3,2]"
    config = job_config(steps=steps)
    reference, _, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    launcher = Launcher(
        config, plan, planner, tmp_path, fail_at={1: 3, 4: 3}, policy=Policy.REROUTE, upgrade_after=2
    )
    result = launcher.run(timeout_s=120)
    policies = [p.policy for p in result.plans]
    assert policies == [Policy.DYNAMIC, Policy.REROUTE, Policy.DYNAMIC]
    assert result.recoveries[0].failed == (1, 4)
    rerouted = [s for p in result.plans[1].pipelines for s in p.stages if s.rerouted]
    # The dead stages (layers 3..5) run on the third pipeline, split over its two nodes.
    assert {(s.node, s.rerouted_to) for s in rerouted} == {(1, (6, 7)), (4, (6, 7))}
    assert len(result.plans[2].nodes) == 6 and result.plans[2].transfer_bytes() > 0
    _assert_matches_reference(result, reference, steps)
    _assert_each_sample_once(result, plan, steps)
    _assert_bytes_equal_transfer_plan(result)


def test_failure_beyond_f_restarts_from_checkpoint(
    tmp_path: Path, gpt_profile: ModelProfile, job_config: Callable[..., JobConfig]
) -> None:
    steps, interval = 8, 3
    planner = RuntimePlanner.for_job(gpt_profile, nodes=4, global_batch=8, microbatch_size=2, dp_range=(2, 2))
    plan = planner.initial()
    config = job_config(steps=steps, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=interval)
    reference, _, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    # Nodes 1 and 3 hold the second stage of both replicas: no live copy of those layers remains.
    stage_nodes = {s.node for p in plan.pipelines for s in p.stages if s.layers[0] > 0}
    assert stage_nodes == {1, 3}
    launcher = Launcher(config, plan, planner, tmp_path / "logs", fail_at={1: 5, 3: 5})
    result = launcher.run(timeout_s=120)
    recovery = result.recoveries[0]
    assert recovery.restarted and result.plans[-1].policy == Policy.CHECKPOINT
    lost = recovery.committed_before - (recovery.committed_before // interval) * interval
    assert recovery.committed_before == 5 and lost <= interval
    assert sorted(result.plans[-1].nodes) == [0, 2]
    _assert_matches_reference(result, reference, steps)
    _assert_each_sample_once(result, plan, steps)


def test_a_world_stopped_with_every_node_alive_ends_the_run_naming_it(
    tmp_path: Path, gpt_profile: ModelProfile, job_config: Callable[..., JobConfig]
) -> None:
    """A worker held past its peer's collective timeout, every process alive: the peer abandons the step and
    no failure explains it. The operator re-forms such a world; the harness ends the run soon, naming it,
    where every worker waited out its plan timeout (60 s) and the run failed on the planner's error."""
    planner = RuntimePlanner.for_job(gpt_profile, nodes=2, global_batch=8, microbatch_size=2, dp_range=(2, 2))
    config = job_config(steps=6, collective_timeout_s=1.0)
    launcher = Launcher(
        config, planner.initial(), planner, tmp_path, hooks={1: StallAt(1, step=2, seconds=6.0)}
    )
    began = time.monotonic()
    with pytest.raises(WorldStopped, match=r"generation 0: node\(s\) \[0.*abandoned its step or switch"):
        launcher.run(timeout_s=60)
    assert time.monotonic() - began < 30
    assert len(launcher.plans) == 1  # nothing was re-planned: nobody failed


def test_a_pipeline_whose_waits_outlast_the_collective_timeout_trains_through(
    tmp_path: Path, job_config: Callable[..., JobConfig]
) -> None:
    """A model whose steps are long beside the collective timeout: a 1F1B stage waits for its first
    backward about a micro-batch's forward and backward of the stage after it (here 0.4 s, with a timeout
    of 0.25 s). The plan's waits are bounded by three of its estimated steps instead, so the job trains
    through; a bound of the bare timeout abandoned the first step, every node alive (`WorldStopped`), and
    the operator would have re-formed the world forever."""
    sleep_s = 0.1
    options = {"layers": 4, "hidden": 8, "forward_sleep_s": sleep_s}
    measured = measure_profile(load_model("sleep", **options), timed=False)  # its bytes; times: the sleeps
    layers = tuple(
        layer.model_copy(update={"forward_s": sleep_s, "backward_s": 2 * sleep_s})
        for layer in measured.layers
    )
    profile = measured.model_copy(update={"layers": layers})
    planner = RuntimePlanner.for_job(
        profile, nodes=2, global_batch=4, microbatch_size=2, fault_tolerance=0, dp_range=(1, 1)
    )
    plan = planner.initial()
    assert plan.layout == "DP1 PP[2]"
    config = job_config(model="sleep", model_options=options, steps=2, collective_timeout_s=0.25)
    assert wait_bound_s(plan, 0.25) == pytest.approx(3 * plan.step_time_s) and plan.step_time_s > 0.5
    result = Launcher(config, plan, planner, tmp_path).run(timeout_s=60)
    assert [value["step"] for value in result.return_values.values()] == [2, 2]
    assert not [key for key in result.events if key.startswith("abort/")]
