"""The job's `WorkersReady` condition: whether every worker pod it asked for runs, and when not, why. Pure.

Before it, a job whose pods could not start read `Running 0/8` in `kubectl get rjob`: the phase follows the
plan, and only the job's Events (which the API server drops after an hour) said that a Secret was missing,
that an image could not be pulled or that no node fitted. The condition keeps the cause in the status for
as long as it holds, and the `Reason` printer column shows it.

The most actionable cause wins: pods the API server refuses (`PodsRefused`), containers the kubelet cannot
start (`PodNotStarting`), pods no node fits (`PodUnschedulable`), workers that failed and are being
recovered from (`NodeFailed`, briefly: the next generation plans around them), workers that exited after
the last step (`TrainingComplete`), the plan's pods still starting (`PodsStarting`). A replacement pod
counts when it is stuck (it is why the job stays degraded), not while it merely starts: the job's workers
all run meanwhile, and the message names it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from . import api
from ._decide import PodView, set_condition

PODS_NAMED = 3
"""Pods a message names; the others are counted."""

HELD_UP = frozenset({api.Reason.PODS_REFUSED, api.Reason.POD_NOT_STARTING, api.Reason.POD_UNSCHEDULABLE})
"""Causes a user fixes (told in Warnings): the job says so in a Normal Event when they are over."""


def workers_ready(
    conditions: list[api.Condition],
    plan_nodes: Iterable[int],
    pods: Mapping[int, PodView],
    refused: str = "",
    lost: Iterable[int] = (),
) -> list[api.Condition]:
    """`conditions` with WorkersReady as `pods` (node -> its pod) say for the plan's nodes, `refused` the
    API server's last refusal of the job's pods ('' when none is outstanding) and `lost` the fenced nodes.
    The same list when the condition already says so: the status is patched only when it changes."""
    ready, reason, message = _verdict(sorted(set(plan_nodes)), pods, refused, set(lost))
    flag = "True" if ready else "False"
    old = next((c for c in conditions if c.type == api.ConditionType.WORKERS_READY), None)
    if old is not None and (old.status, old.reason, old.message) == (flag, reason, message):
        return conditions
    return set_condition(conditions, api.ConditionType.WORKERS_READY, ready, reason, message)


def not_ready(status: api.ResilientJobStatus) -> str | None:
    """Why the job's worker pods do not all run, for `rjob_workers_not_ready`: the WorkersReady condition's
    reason while it is False and the job runs; None when they do, and for a job that ended."""
    if status.phase in (api.Phase.SUCCEEDED, api.Phase.FAILED):
        return None
    ready = next((c for c in status.conditions if c.type == api.ConditionType.WORKERS_READY), None)
    return ready.reason.value if ready is not None and ready.status == "False" else None


def failed(conditions: list[api.Condition], reason: api.Reason, why: str) -> list[api.Condition]:
    """WorkersReady of a job that failed (`reason`, as its Valid or Planned condition says): no worker runs
    any more, its pods are deleted. Left as it was, the column read `AllWorkersRunning` on a Failed job."""
    message = f"no worker runs: the job failed: {why}"
    return set_condition(conditions, api.ConditionType.WORKERS_READY, False, reason, message)


def _verdict(
    planned: list[int], pods: Mapping[int, PodView], refused: str, lost: set[int]
) -> tuple[bool, api.Reason, str]:
    if refused:
        return False, api.Reason.PODS_REFUSED, refused
    # Pods on their way out are the fencing's; a Succeeded one trained to the end.
    present = [pods[node] for node in sorted(pods) if not pods[node].deleting and not pods[node].completed]
    stuck = [pod for pod in present if pod.not_starting]
    if stuck:
        return False, api.Reason.POD_NOT_STARTING, _named(stuck, "does not start", lambda p: p.not_starting)
    unplaced = [pod for pod in present if pod.unschedulable and pod.phase == "Pending"]
    if unplaced:
        said = _named(unplaced, "cannot be scheduled", lambda p: p.unschedulable.rstrip("."))
        return False, api.Reason.POD_UNSCHEDULABLE, said
    failed = [node for node in planned if node in lost or (node in pods and pods[node].failed is not None)]
    if failed:
        first = failed[0]
        why = pods[first].failed if first in pods and pods[first].failed else "fenced"
        said = f"{len(failed)} of {len(planned)} workers failed, recovering; node {first}: {why}"
        return False, api.Reason.NODE_FAILED, said
    exited = [node for node in planned if node in pods and pods[node].completed]
    if exited:
        # The last step: the workers exit one by one as they finish writing (the job completes after).
        said = f"{len(exited)} of {len(planned)} workers trained to the end and exited"
        return False, api.Reason.TRAINING_COMPLETE, said
    running = [pod for pod in present if pod.phase == "Running" and pod.failed is None]
    working = sum(1 for pod in running if pod.node in planned)
    # The plan's own pods that do not run yet hold the job up; a replacement on its way does not (it joins
    # once it runs; Degraded says what the job lacks meanwhile), unless it is stuck (above).
    starting = [pod for pod in present if pod not in running and pod.failed is None]
    held = [pod.name for pod in starting if pod.node in planned]
    missing = [f"node {node} (no pod yet)" for node in planned if node not in pods]
    if held or missing:
        waiting = [*held, *missing]
        said = f"{working} of {len(planned)} workers running; starting: {', '.join(waiting[:PODS_NAMED])}"
        more = len(waiting) - PODS_NAMED
        return False, api.Reason.PODS_STARTING, said + (f" and {more} more" if more > 0 else "")
    joining = [pod.name for pod in starting if pod.node not in planned]
    said = f"{working} of {len(planned)} workers running"
    if joining:
        said += f"; replacements starting: {', '.join(joining[:PODS_NAMED])}"
        said += f" and {len(joining) - PODS_NAMED} more" if len(joining) > PODS_NAMED else ""
    return True, api.Reason.ALL_WORKERS_RUNNING, said


def _named(pods: list[PodView], what: str, why: Callable[[PodView], str]) -> str:
    """'pod a <what>: <why>' for the first pod, and how many more are held up alike."""
    more = f" (and {len(pods) - 1} more pods)" if len(pods) > 1 else ""
    return f"pod {pods[0].name} {what}: {why(pods[0])}{more}"
