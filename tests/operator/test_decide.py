"""The reconciler's pure rules about pods: a worker that finished training is not a failure, and the job is
complete only when every node of the plan has finished."""

from __future__ import annotations

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
