"""Every node of the plan lost at once: wait for the replacements, restart from the checkpoint, and end a
crash loop.

A spot reclaim or a drained node pool takes every worker of a generation; so does a bug that crashes every
worker at the same step. Nobody survives to plan around (the planner alone would fail the job), so the job
waits for its replacement pods (`_capacity`) and restarts from its checkpoint on them.

The wait is said where a user looks: the Planned condition turns False (WaitingForReplacements) naming what
failed and what the replacements are doing, a replacement the scheduler cannot place included, and each loss
is told once in an Event. Each loss is counted once, in the status (`status.capacity.wholeJobLoss`), so that
an operator restarted while the job waits neither forgets nor doubles it. A loss after a restart that
committed no step past the one before is one more in a row; one past `spec.checkpoint.restartLimit` in a
row ends the job (RestartLimitExceeded): every restart met the same crash, and another would too.

The record (`counted`) and the words (`waiting_message`, `limit_message`) are pure; `wait` applies them to
one job's status, which is all the state there is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from . import _decide, api
from ._fencing import Fenced
from ._job_view import JobView

CAUSES_SHOWN = 3
"""Failed nodes whose causes a message names (a job of hundreds lost at once says the first few)."""


def counted(record: api.WholeJobLoss | None, generation: int, step: int) -> api.WholeJobLoss:
    """The record once every node of `generation` failed with `step` committed. The same loss seen again
    only raises its step (the last steps' telemetry may arrive after the failure); a new one is one more in
    a row, or the first of a new row when a step past the previous loss's committed since."""
    if record is not None and record.generation == generation:
        if step <= record.step:
            return record
        # Telemetry of the loss arriving after it: it committed more than first seen. In a row, the record's
        # step is the loss's before (counted against), so more is a step past it: the first of a new row.
        return api.WholeJobLoss(generation=generation, step=step, in_a_row=1)
    if record is not None and step <= record.step:
        return api.WholeJobLoss(generation=generation, step=record.step, in_a_row=record.in_a_row + 1)
    return api.WholeJobLoss(generation=generation, step=step, in_a_row=1)


def _causes(fenced: Mapping[int, Fenced]) -> str:
    named = [f"node {node}: {fenced[node].cause}" for node in sorted(fenced)[:CAUSES_SHOWN]]
    more = len(fenced) - CAUSES_SHOWN
    return "; ".join(named) + (f"; {more} more" if more > 0 else "")


def _replacements(pods: Mapping[int, _decide.PodView], plan_nodes: set[int]) -> str:
    """What the pods outside the lost plan (the replacements) are doing, as '2 Running, 2 Pending (...)'."""
    waiting = [pod for node, pod in sorted(pods.items()) if node not in plan_nodes and pod.failed is None]
    if not waiting:
        return "none asked for yet"
    phases = Counter(pod.phase for pod in waiting)
    said = ", ".join(f"{count} {phase}" for phase, count in sorted(phases.items()))
    unschedulable = next((pod for pod in waiting if pod.unschedulable), None)
    if unschedulable is not None:
        said += f"; node {unschedulable.node} cannot be scheduled: {unschedulable.unschedulable.rstrip('.')}"
    return said


def waiting_message(
    record: api.WholeJobLoss,
    limit: int,
    fenced: Mapping[int, Fenced],
    pods: Mapping[int, _decide.PodView],
    plan_nodes: set[int],
) -> str:
    """The Planned condition's message while the job waits for its replacements."""
    return (
        f"every node of generation {record.generation} failed at step {record.step} ({_causes(fenced)}); "
        f"restarting from the checkpoint once the replacements run: {_replacements(pods, plan_nodes)}. "
        f"Whole-job failure {record.in_a_row} in a row; the job ends after {limit + 1} "
        "(checkpoint.restartLimit)"
    )


def limit_message(record: api.WholeJobLoss, limit: int, fenced: Mapping[int, Fenced]) -> str:
    """Why the job ends: every restart allowed was lost before it passed the step of the one before."""
    return (
        f"every node failed {record.in_a_row} times in a row with no step committed past step {record.step} "
        f"(limit {limit}); the last time: {_causes(fenced)}"
    )


async def wait(
    ctl: JobView, generation: int, plan_nodes: set[int], fenced: Mapping[int, Fenced]
) -> str | None:
    """Count the loss of `generation` (once) and say in the Planned condition that the job waits (written
    when the record or the words changed); the line ending the job when this loss is one past
    `checkpoint.restartLimit` (judged a pass after it was counted), else None."""
    limit = ctl.require_spec().checkpoint.restart_limit
    before = ctl.status.capacity.whole_job_loss
    record = counted(before, generation, ctl.status.step)
    if record != before:
        capacity = ctl.status.capacity.model_copy(update={"whole_job_loss": record})
        ctl.status = ctl.status.model_copy(update={"capacity": capacity})
    # Ended on a record counted a pass before, whose telemetry has been read since: the last steps before a
    # failure may arrive after it, and show that the restart trained past the loss before (a new row).
    if record.in_a_row > limit:
        if record == before:
            return limit_message(record, limit, fenced)
        await ctl.write_status(force=True)  # counted, durable; judged by the next pass
        return None
    message = waiting_message(record, limit, fenced, ctl.pods, plan_nodes)
    planned = next((c for c in ctl.status.conditions if c.type == api.ConditionType.PLANNED), None)
    said = planned is not None and (planned.reason, planned.message) == (
        api.Reason.WAITING_FOR_REPLACEMENTS,
        message,
    )
    if before is None or before.generation != generation or before.in_a_row > limit:
        # A new loss, or one that its late telemetry showed to be no repeat. Said before the write: a write
        # that fails is retried on a status that has the loss counted already.
        ctl.event("Warning", api.Reason.WAITING_FOR_REPLACEMENTS, message)
    if not said or record != before:
        conditions = _decide.set_condition(
            ctl.status.conditions,
            api.ConditionType.PLANNED,
            False,
            api.Reason.WAITING_FOR_REPLACEMENTS,
            message,
        )
        ctl.status = ctl.status.model_copy(update={"conditions": conditions})
        await ctl.write_status(force=True)  # the count is durable before anything else is done
    return None
