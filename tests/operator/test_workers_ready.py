"""The WorkersReady condition: every worker pod running, or the one cause a user acts on first."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from resilientjob.operator import api
from resilientjob.operator._decide import PodView, pod_view
from resilientjob.operator._manifests import LABEL_JOB, LABEL_NODE, job_label
from resilientjob.operator._workers_ready import workers_ready


def _pod(node: int, phase: str = "Running", **fields: Any) -> PodView:
    return PodView(
        node=node,
        name=f"job-node-{node}",
        uid=f"u{node}",
        phase=phase,
        ready=phase == "Running",
        deleting=False,
        reason="",
        **fields,
    )


def _condition(conditions: list[api.Condition]) -> api.Condition:
    found = [c for c in conditions if c.type == api.ConditionType.WORKERS_READY]
    assert len(found) == 1, conditions
    return found[0]


def _ready(pods: dict[int, PodView], plan: range = range(4), **kwargs: Any) -> api.Condition:
    return _condition(workers_ready([], plan, pods, **kwargs))


def test_every_worker_running_is_ready_and_an_unchanged_condition_is_the_same_list() -> None:
    pods = {n: _pod(n) for n in range(4)}
    conditions = workers_ready([], range(4), pods)
    ready = _condition(conditions)
    assert (ready.status, ready.reason, ready.message) == (
        "True",
        "AllWorkersRunning",
        "4 of 4 workers running",
    )
    # Level-triggered: the same verdict leaves the list as it was, so the status is not patched again.
    assert workers_ready(conditions, range(4), pods) is conditions
    pods[2] = _pod(2, "Pending")
    changed = workers_ready(conditions, range(4), pods)
    assert changed is not conditions and _condition(changed).status == "False"


def test_a_missing_secret_key_names_the_pod_and_the_kubelets_words() -> None:
    raw = {
        "metadata": {
            "name": "job-node-1",
            "uid": "u1",
            "labels": {LABEL_JOB: job_label("job"), LABEL_NODE: "1"},
        },
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "state": {
                        "waiting": {
                            "reason": "CreateContainerConfigError",
                            "message": "couldn't find key token in Secret default/tracker",
                        }
                    }
                }
            ],
        },
    }
    stuck = pod_view(raw, "job")
    assert stuck is not None and stuck.not_starting.startswith(
        "CreateContainerConfigError: couldn't find key"
    )
    condition = _ready({0: _pod(0), 1: stuck, 2: _pod(2), 3: replace(stuck, node=3, name="job-node-3")})
    assert (condition.status, condition.reason) == ("False", "PodNotStarting")
    assert condition.message == (
        "pod job-node-1 does not start: CreateContainerConfigError: couldn't find key token in Secret "
        "default/tracker (and 1 more pods)"
    )


def test_the_cause_a_user_acts_on_first_wins() -> None:
    unplaced = _pod(3, "Pending", unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
    image = _pod(2, "Pending", not_starting="ImagePullBackOff: Back-off pulling image")
    failed = _pod(1, "Failed")
    pods = {0: _pod(0), 1: failed, 2: image, 3: unplaced}
    refused = 'the API server refused the job\'s worker pods: serviceaccounts "trainer" not found'
    assert _ready(pods, refused=refused).reason == "PodsRefused"
    assert _ready(pods, refused=refused).message == refused
    assert _ready(pods).reason == "PodNotStarting"
    del pods[2]
    condition = _ready(pods)
    assert condition.reason == "PodUnschedulable"
    assert condition.message == (
        "pod job-node-3 cannot be scheduled: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu"
    )
    del pods[3]
    condition = _ready(pods, plan=range(3))
    assert condition.reason == "NodeFailed" and condition.message.startswith("1 of 3 workers failed")
    assert "node 1: pod failed" in condition.message
    # A fenced node whose pod is already gone is still a failed worker of this plan.
    assert _ready({0: _pod(0), 2: _pod(2)}, plan=range(3), lost=[1]).message.endswith("node 1: fenced")


def test_the_plans_pods_still_starting_are_counted_and_named() -> None:
    # Node 5: a replacement, not planned yet (it is named only when stuck, or beside all running).
    pods = {0: _pod(0), 1: _pod(1, "Pending"), 5: _pod(5, "Pending")}
    condition = _ready(pods, plan=range(5))
    assert (condition.status, condition.reason) == ("False", "PodsStarting")
    assert condition.message == (
        "1 of 5 workers running; starting: job-node-1, node 2 (no pod yet), node 3 (no pod yet) and 1 more"
    )


def test_a_replacement_on_its_way_holds_nothing_up_but_a_stuck_one_does() -> None:
    """After a kill the job trains on its three workers while node 4's pod starts: `3/3` beside
    PodsStarting read as a contradiction. A replacement that cannot start is why the job stays degraded."""
    pods = {0: _pod(0), 1: _pod(1), 2: _pod(2), 4: _pod(4, "Pending")}
    condition = _ready(pods, plan=range(3))
    assert (condition.status, condition.reason) == ("True", "AllWorkersRunning")
    assert condition.message == "3 of 3 workers running; replacements starting: job-node-4"
    pods[4] = _pod(4, "Pending", not_starting="ErrImagePull: not found")
    assert _ready(pods, plan=range(3)).reason == "PodNotStarting"


def test_workers_that_exited_after_the_last_step_are_not_all_running() -> None:
    pods = {0: _pod(0, "Succeeded"), 1: _pod(1), 2: _pod(2)}
    condition = _ready(pods, plan=range(3))
    assert (condition.status, condition.reason) == ("False", "TrainingComplete")
    assert condition.message == "1 of 3 workers trained to the end and exited"


def test_pods_on_their_way_out_and_finished_ones_outside_the_plan_hold_nothing_up() -> None:
    pods = {n: _pod(n) for n in range(3)}
    pods[3] = replace(_pod(3, "Pending", not_starting="ErrImagePull: nope"), deleting=True)
    pods[4] = _pod(4, "Succeeded")  # a parked or idle node's probe that ended
    assert _ready(pods, plan=range(3)).reason == "AllWorkersRunning"


def test_the_transition_time_stays_while_the_status_does_not_change() -> None:
    first = workers_ready([], range(2), {0: _pod(0, "Pending")})
    stamped = replace_time(first, "2026-01-01T00:00:00Z")
    later = workers_ready(stamped, range(2), {0: _pod(0), 1: _pod(1, "Pending")})
    assert _condition(later).message != _condition(stamped).message
    assert _condition(later).last_transition_time == "2026-01-01T00:00:00Z"
    assert _condition(workers_ready(later, range(2), {0: _pod(0), 1: _pod(1)})).last_transition_time != (
        "2026-01-01T00:00:00Z"
    )


def replace_time(conditions: list[api.Condition], when: str) -> list[api.Condition]:
    return [c.model_copy(update={"last_transition_time": when}) for c in conditions]


def test_the_not_ready_series_follows_the_condition_and_ends_with_the_job() -> None:
    from resilientjob.operator._workers_ready import failed, not_ready

    stuck = workers_ready([], range(2), {0: _pod(0), 1: _pod(1, "Pending", not_starting="ErrImagePull: x")})
    status = api.ResilientJobStatus(phase=api.Phase.RUNNING, conditions=stuck)
    assert not_ready(status) == "PodNotStarting"
    running = workers_ready(stuck, range(2), {0: _pod(0), 1: _pod(1)})
    assert not_ready(status.model_copy(update={"conditions": running})) is None
    ended = status.model_copy(
        update={"phase": api.Phase.FAILED, "conditions": failed(stuck, api.Reason.INVALID_SPEC, "x")}
    )
    assert not_ready(ended) is None and not_ready(api.ResilientJobStatus()) is None
