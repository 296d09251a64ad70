"""Whole-job losses counted once each, in a row only while no step passes the one before, and said with
what the replacements are doing (`_whole_job`)."""

from __future__ import annotations

from typing import Any

from resilientjob.operator import _whole_job, api
from resilientjob.operator._decide import PodView, pod_view
from resilientjob.operator._fencing import Fenced
from resilientjob.operator._manifests import LABEL_JOB, LABEL_NODE, job_label


def test_a_loss_is_counted_once_however_many_passes_see_it() -> None:
    first = _whole_job.counted(None, generation=3, step=120)
    assert (first.generation, first.step, first.in_a_row) == (3, 120, 1)
    assert _whole_job.counted(first, 3, 120) is first
    # The last steps' telemetry arrives after the failure: the same loss, a higher step.
    later = _whole_job.counted(first, 3, 124)
    assert (later.generation, later.step, later.in_a_row) == (3, 124, 1)


def test_losses_are_in_a_row_until_a_step_passes_the_one_before() -> None:
    lost = _whole_job.counted(None, 3, 124)
    # Restarted from an earlier checkpoint, lost again at the same step (or before it): one more in a row.
    again = _whole_job.counted(lost, 4, 124)
    assert (again.generation, again.step, again.in_a_row) == (4, 124, 2)
    sooner = _whole_job.counted(again, 5, 90)
    assert (sooner.step, sooner.in_a_row) == (124, 3)
    # A restart that trained past it: whatever fails now is a new failure, not the same crash.
    past = _whole_job.counted(sooner, 6, 125)
    assert (past.generation, past.step, past.in_a_row) == (6, 125, 1)


def test_a_loss_whose_late_telemetry_passes_the_loss_before_starts_a_new_row() -> None:
    first = _whole_job.counted(None, 0, 100)
    # Every node of generation 1 fails; the steps it committed since its restart are not read yet.
    early = _whole_job.counted(first, 1, 98)
    assert (early.step, early.in_a_row) == (100, 2)
    # They arrive: it trained past step 100, so it met no repeat of the first crash.
    late = _whole_job.counted(early, 1, 130)
    assert (late.generation, late.step, late.in_a_row) == (1, 130, 1)


def _pod(node: int, phase: str, unschedulable: str = "") -> PodView:
    return PodView(
        node=node, name=f"j-node-{node}", uid=f"u{node}", phase=phase, ready=phase == "Running",
        deleting=False, reason="", unschedulable=unschedulable,
    )  # fmt: skip


def test_the_waiting_message_names_causes_replacements_and_the_limit() -> None:
    record = api.WholeJobLoss(generation=2, step=40, in_a_row=2)
    fenced = {n: Fenced(api.Reason.NODE_FAILED, f"exit {n}", None) for n in range(5)}
    pods = {
        5: _pod(5, "Running"),
        6: _pod(6, "Pending", "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."),
        7: _pod(7, "Pending"),
    }
    message = _whole_job.waiting_message(record, 3, fenced, pods, plan_nodes=set(range(5)))
    assert "every node of generation 2 failed at step 40" in message
    assert "node 0: exit 0; node 1: exit 1; node 2: exit 2; 2 more" in message
    assert "2 Pending, 1 Running" in message
    assert (
        "node 6 cannot be scheduled: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu. Whole" in message
    )
    assert "failure 2 in a row; the job ends after 4 (checkpoint.restartLimit)" in message
    none_yet = _whole_job.waiting_message(record, 3, fenced, {}, plan_nodes=set(range(5)))
    assert "none asked for yet" in none_yet


def test_the_limit_message_says_how_often_and_at_which_step() -> None:
    record = api.WholeJobLoss(generation=6, step=40, in_a_row=4)
    fenced = {9: Fenced(api.Reason.NODE_FAILED, "pod Failed (Error): ZeroDivisionError", None)}
    message = _whole_job.limit_message(record, 3, fenced)
    assert message.startswith("every node failed 4 times in a row with no step committed past step 40")
    assert "(limit 3)" in message and "node 9: pod Failed (Error): ZeroDivisionError" in message


def _pod_object(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {"name": "j-node-4", "labels": {LABEL_JOB: job_label("j"), LABEL_NODE: "4"}},
        "status": {"phase": "Pending", "conditions": conditions},
    }


def test_a_pod_the_scheduler_cannot_place_says_why() -> None:
    why = "0/3 nodes are available: 3 Insufficient cpu."
    stuck = pod_view(
        _pod_object([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}]),
        "j",
    )
    assert stuck is not None and stuck.unschedulable == why
    # Scheduled (or not yet tried): nothing to say.
    placed = pod_view(_pod_object([{"type": "PodScheduled", "status": "True"}]), "j")
    assert placed is not None and placed.unschedulable == ""
    gated = pod_view(
        _pod_object([{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]), "j"
    )
    assert gated is not None and gated.unschedulable == ""
