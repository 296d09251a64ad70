"""The reconciler's pure rules about pods: a worker that finished training is not a failure, and the job is
complete only when every node of the plan has finished."""

from __future__ import annotations

from typing import Any

from resilientjob.operator import api
from resilientjob.operator._decide import Observation, PodView, detect_failures, training_complete
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan


def _plan(nodes: list[int]) -> Plan:
    pipelines = tuple(
        PipelinePlan(stages=(StagePlan(layers=(0, 4), node=node),), microbatches=1) for node in nodes
    )
    return Plan(policy=Policy.DYNAMIC, microbatch_size=1, pipelines=pipelines, step_time_s=1.0)


def _pod(node: int, phase: str, deleting: bool = False) -> PodView:
    return PodView(
        node=node, name=f"job-node-{node}", uid=str(node), phase=phase, ready=phase == "Running",
        deleting=deleting, reason="",
    )  # fmt: skip


def test_finished_workers_are_not_failures_and_complete_the_job_together() -> None:
    plan = _plan([0, 1, 2])
    pods = {0: _pod(0, "Succeeded"), 1: _pod(1, "Succeeded"), 2: _pod(2, "Running")}
    # A finished worker's heartbeat stops: that is not a death either.
    observed = Observation(pods=pods, expired_heartbeats=frozenset({0, 1}))
    assert detect_failures(plan, observed) == {}
    assert not training_complete(plan, observed)
    pods[2] = _pod(2, "Succeeded")
    assert training_complete(plan, Observation(pods=pods, expired_heartbeats=frozenset({0, 1, 2})))


def test_a_failure_beside_finished_workers_is_still_a_failure() -> None:
    plan = _plan([0, 1, 2])
    pods = {0: _pod(0, "Succeeded"), 1: _pod(1, "Failed"), 2: _pod(2, "Succeeded", deleting=True)}
    observed = Observation(pods=pods, expired_heartbeats=frozenset())
    failures = detect_failures(plan, observed)
    assert set(failures) == {1, 2} and all(
        reason is api.Reason.NODE_FAILED for reason, _ in failures.values()
    )
    assert not training_complete(plan, observed)
    assert not training_complete(
        plan, Observation(pods={0: _pod(0, "Succeeded")}, expired_heartbeats=frozenset())
    )


def test_a_completed_job_lists_no_slow_node_and_no_worker_at_work() -> None:
    from resilientjob.operator._decide import completed
    from resilientjob.operator._redis_state import announcement

    status = api.ResilientJobStatus(
        phase=api.Phase.RUNNING, slow_nodes=[0], workers_alive=1, workers_total=2, workers="1/2"
    )
    done, message = completed(status, announcement(_plan([0, 1])))
    assert done.phase is api.Phase.SUCCEEDED and done.slow_nodes == []
    assert (done.workers, done.workers_alive) == ("0/2", 0)  # not the last pass's count, as pods completed
    complete = next(c for c in done.conditions if c.type == api.ConditionType.COMPLETE)
    assert complete.reason == api.Reason.TRAINING_COMPLETE and message.startswith("training finished")
    # The Reason column says so too, as a completed pod's Ready is False: the workers exited.
    ready = next(c for c in done.conditions if c.type == api.ConditionType.WORKERS_READY)
    assert (ready.status, ready.reason) == ("False", api.Reason.TRAINING_COMPLETE)


def test_a_worker_stopped_by_the_spec_is_told_from_a_node_failure() -> None:
    from resilientjob.operator._decide import workload_error

    plan = _plan([0, 1])
    bad = PodView(
        node=1, name="job-node-1", uid="1", phase="Failed", ready=False, deleting=False, reason="Error",
        last_words="workload: spec.data.path: /d/t.bin: sample 7 holds token 53",
    )  # fmt: skip
    killed = PodView(
        node=0, name="job-node-0", uid="0", phase="Failed", ready=False, deleting=False, reason="Error",
        last_words="Signal 9",
    )  # fmt: skip
    observed = Observation(pods={0: killed, 1: bad}, expired_heartbeats=frozenset())
    assert workload_error(plan, observed) == (
        1,
        "spec.data.path",
        "spec.data.path: /d/t.bin: sample 7 holds token 53",
    )
    assert workload_error(plan, Observation(pods={0: killed}, expired_heartbeats=frozenset())) is None


def test_a_pending_pod_is_not_counted_as_a_working_worker() -> None:
    """An unschedulable job read `4/4` and "every node in use": a pod counted once it merely existed."""
    import asyncio

    from resilientjob.operator._pods import WorkerPods

    pods = WorkerPods(None, "ns", "job", asyncio.Event())  # type: ignore[arg-type]  # no API call here
    pods.views = {0: _pod(0, "Running"), 1: _pod(1, "Pending"), 2: _pod(2, "Failed")}
    assert [pods.working(node) for node in range(4)] == [True, False, False, False]
    assert [pods.running(node) for node in range(4)] == [True, True, False, False]  # exists, not failed


def test_a_joiner_holds_its_copied_layers_only_once_a_step_of_its_generation_committed() -> None:
    from resilientjob.operator._decide import unconfirmed_copies
    from resilientjob.planner.plan import Transfer

    # Generation 2: node 2 joined in node 0's place, its four layers copied from node 1.
    joined = _plan([1, 2]).model_copy(
        update={"transfers": tuple(Transfer(layer=i, src=1, dst=2, bytes=8) for i in range(4))}
    )
    assert unconfirmed_copies(joined, stepped_generation=1, generation=2) == {2}
    assert unconfirmed_copies(joined, stepped_generation=None, generation=2) == {2}
    assert unconfirmed_copies(joined, stepped_generation=2, generation=2) == set()  # a step committed
    # A node that kept a layer it had is no joiner: it still holds what it had.
    partly = _plan([1, 2]).model_copy(update={"transfers": (Transfer(layer=0, src=1, dst=2, bytes=8),)})
    assert unconfirmed_copies(partly, stepped_generation=1, generation=2) == set()


def test_every_node_of_a_restart_from_the_checkpoint_holds_nothing_until_a_step_of_it_commits() -> None:
    """A node that starts after the next plan is out reads that plan and never loads the checkpoint: a plan
    on top of an unconfirmed restart restarts from the checkpoint again (the planner, given every node as
    emptied, has no other choice), so a join right after a restart no longer counts on layers nobody
    loaded."""
    from resilientjob.operator._decide import unconfirmed_copies
    from resilientjob.planner import ClusterSpec, JobSpec, uniform_profile
    from resilientjob.planner.search import replan

    restart = _plan([0, 1, 2]).model_copy(update={"policy": Policy.CHECKPOINT})
    assert unconfirmed_copies(restart, stepped_generation=2, generation=3) == {0, 1, 2}
    # Unknown (a restarted operator with Redis emptied): not restarted again on a guess, which could cost
    # every step since the checkpoint.
    assert unconfirmed_copies(restart, stepped_generation=None, generation=3) == set()
    assert unconfirmed_copies(restart, stepped_generation=3, generation=3) == set()
    # Generation 0 of policy checkpoint is the first start: every node initialises its layers itself.
    assert unconfirmed_copies(restart, stepped_generation=None, generation=0) == set()

    profile, job = uniform_profile(4), JobSpec(global_batch=12, microbatch_size=1, fault_tolerance=1)
    cluster = ClusterSpec(nodes=4)
    trusted = replan(restart, profile, cluster, job, joined=[3])
    assert trusted.policy is not Policy.CHECKPOINT
    doubted = replan(
        restart, profile, cluster, job, joined=[3], emptied=sorted(unconfirmed_copies(restart, 2, 3))
    )
    assert doubted.policy is Policy.CHECKPOINT and 3 in doubted.nodes


def test_the_telemetry_condition_follows_redis_and_changes_only_when_redis_does() -> None:
    from resilientjob.operator import api
    from resilientjob.operator._decide import telemetry_condition

    never_lost: list[api.Condition] = []
    assert telemetry_condition(never_lost, redis_down=False) is never_lost  # no condition, no write
    down = telemetry_condition(never_lost, redis_down=True, outage=ConnectionError("refused"))
    (condition,) = down
    assert (condition.status, condition.reason) == ("False", api.Reason.REDIS_UNAVAILABLE)
    assert "ConnectionError" in condition.message and "as of its last answer" in condition.message
    assert telemetry_condition(down, redis_down=True) is down  # every failed pass: nothing to write
    back = telemetry_condition(down, redis_down=False, back_after_s=12.34)
    assert (back[0].status, back[0].reason) == ("True", api.Reason.REDIS_AVAILABLE)
    assert back[0].message == "Redis answers again after 12.3 s"
    assert telemetry_condition(back, redis_down=False) is back
    # A False left by an operator that restarted during the outage: the first pass that finds Redis says so.
    assert telemetry_condition(down, redis_down=False)[0].message == "Redis answers again"


LAYER = {"forwardS": 0.01, "backwardS": 0.02, "paramBytes": 1, "optimizerBytes": 2, "activationBytes": 1}


def test_a_job_lost_after_its_last_step_says_where_the_trained_model_is() -> None:
    from resilientjob.operator._decide import lost_after_training

    def spec(**fields: Any) -> api.ResilientJobSpec:
        return api.ResilientJobSpec.model_validate(
            {
                "image": "w", "model": "hf:/models/m", "nodes": 2, "globalBatchSize": 4, "microBatchSize": 1,
                "faultTolerance": 1, "training": {"steps": 90}, **fields,
            }
        )  # fmt: skip

    volume = {"path": "/ckpt", "volume": "shared"}
    field, line = lost_after_training(spec(output={"path": "/out"}, checkpoint=volume))
    assert field == "spec.output.path" and "after the last step (90) committed" in line
    export = "`rjob export /ckpt --model hf:/models/m --out DIR` (on spec.checkpoint.volume)"
    assert f"{export} writes it from the step 90 checkpoint" in line
    field, line = lost_after_training(spec(output={"path": "/out"}))  # each pod's emptyDir: gone with it
    assert field == "spec.output.path" and "no checkpoint holds it" in line and "rjob export" not in line
    field, line = lost_after_training(spec(checkpoint=volume))
    assert field == "spec.checkpoint.path" and "the trained model or the one before it; `rjob export" in line
    field, line = lost_after_training(
        spec(model="pkg.mod:build", checkpoint=volume, profile={"inline": [LAYER] * 4})
    )
    assert field == "spec.checkpoint.path" and "rjob export" not in line  # no Hugging Face layout to write
    assert lost_after_training(spec())[0] == "spec.checkpoint.volume"
