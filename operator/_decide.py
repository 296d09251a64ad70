"""Pure decisions of the reconciler: which nodes have failed or joined, given what the API server and Redis
say, and what the status should read afterwards. No I/O here, so every rule is unit-testable."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from resilientjob.planner.plan import Plan, Policy
from resilientjob.protocol.messages import PlanAnnouncement, workload_termination
from resilientjob.protocol.models import ModelSource, model_source

from . import api
from ._manifests import ANNOTATION_GENERATION, ANNOTATION_STRIKES, LABEL_JOB, LABEL_NODE, job_label

# Pod-level signals that the node under a pod is gone, as the node lifecycle controller reports them.
NODE_LOST_REASONS = frozenset(
    {"NodeLost", "Evicted", "NodeShutdown", "Terminated", "UnexpectedAdmissionError"}
)


def now_rfc3339() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


LAST_WORDS_SHOWN = 300
"""Characters of a failed container's last line that a failure's cause quotes."""

NOT_STARTING_REASONS = frozenset(
    {
        "CreateContainerConfigError",  # a Secret or ConfigMap key its env names is missing
        "CreateContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
    }
)
"""Why a kubelet keeps a container waiting that will not start by itself (the pod stays Pending)."""


def not_starting(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of a container of `pod` that the kubelet cannot start, or None."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = ((container or {}).get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in NOT_STARTING_REASONS:
            return str(reason), str(waiting.get("message") or "")[:1024]
    return None


@dataclass(frozen=True, slots=True)
class PodView:
    """What the reconciler needs to know about one worker pod."""

    node: int
    name: str
    uid: str
    phase: str
    ready: bool
    deleting: bool
    reason: str
    generation: str = ""
    """The pod's generation annotation: a pod already showing the generation is not patched again."""
    created: str = ""
    """creationTimestamp (RFC 3339): how long a failed pod lived decides its crash-loop backoff."""
    strikes: int = 0
    """Quick failures in a row of the pods this one replaced (`_capacity`)."""
    last_words: str = ""
    """The worker container's termination message, when it left one."""
    unschedulable: str = ""
    """Why the scheduler finds no node for it (its PodScheduled condition), while it finds none."""
    not_starting: str = ""
    """'<reason>: <message>' of a container the kubelet cannot start (`not_starting`), while it cannot."""

    @property
    def completed(self) -> bool:
        """The worker exited cleanly: it trained to the end (not a failure, and its heartbeat stops)."""
        return self.phase == "Succeeded" and not self.deleting

    @property
    def failed(self) -> str | None:
        """Why this pod no longer runs a healthy worker, or None."""
        if self.deleting:
            return "pod is being deleted"
        if self.phase == "Failed":
            # The container's last words (its termination message) say what crashed; their last line is
            # the exception, as a Python traceback ends.
            lines = self.last_words.strip().splitlines()
            said = f": {lines[-1][:LAST_WORDS_SHOWN]}" if lines else ""
            return "pod failed" + (f" ({self.reason})" if self.reason else "") + said
        if self.reason in NODE_LOST_REASONS:
            return f"node lost ({self.reason})"
        return None


def pod_view(pod: Mapping[str, Any], job: str) -> PodView | None:
    """The view of a pod of `job`, or None for any other pod (or one without a valid node label)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_JOB) != job_label(job):
        return None
    try:
        node = int(labels.get(LABEL_NODE, ""))
    except ValueError:
        return None
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    node_not_ready = any(
        c.get("type") == "Ready" and c.get("status") != "True" and c.get("reason") == "NodeNotReady"
        for c in conditions
    )
    reason = str(status.get("reason") or ("NodeLost" if node_not_ready else ""))
    annotations = meta.get("annotations") or {}
    strikes = str(annotations.get(ANNOTATION_STRIKES, "0"))
    last_words = ""
    for container in status.get("containerStatuses") or []:
        terminated = ((container or {}).get("state") or {}).get("terminated") or {}
        if isinstance(terminated.get("message"), str):
            last_words = terminated["message"][:4096]
    unschedulable = next(
        (
            str(c.get("message") or "no node fits it")[:1024]
            for c in conditions
            if c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ),
        "",
    )
    return PodView(
        node=node,
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid") or ""),
        phase=str(status.get("phase") or "Pending"),
        ready=ready,
        deleting=bool(meta.get("deletionTimestamp")),
        reason=reason,
        generation=str(annotations.get(ANNOTATION_GENERATION, "")),
        created=str(meta.get("creationTimestamp") or ""),
        strikes=int(strikes) if strikes.isdigit() else 0,
        last_words=last_words,
        unschedulable=unschedulable,
        not_starting=": ".join(part for part in not_starting(pod) or () if part),
    )


@dataclass(frozen=True, slots=True)
class Observation:
    """One snapshot of a job's workers."""

    pods: Mapping[int, PodView]
    expired_heartbeats: frozenset[int]


def detect_failures(plan: Plan, observed: Observation) -> dict[int, tuple[api.Reason, str]]:
    """Nodes the plan uses that have failed, with the reason and a human explanation."""
    failures: dict[int, tuple[api.Reason, str]] = {}
    for node in plan.nodes:
        pod = observed.pods.get(node)
        if pod is None:
            failures[node] = (api.Reason.NODE_FAILED, "pod deleted")
        elif pod.completed:
            continue  # finished training; its peers finish the same step
        elif pod.failed is not None:
            failures[node] = (api.Reason.NODE_FAILED, pod.failed)
        elif node in observed.expired_heartbeats:
            failures[node] = (api.Reason.HEARTBEAT_EXPIRED, "heartbeat expired in Redis")
    return failures


def workload_error(plan: Plan, observed: Observation) -> tuple[int, str, str] | None:
    """(node, field, line) of a failed worker of `plan` that stopped because of the job's spec (its agent's
    termination message, `protocol.messages.workload_termination`): the job fails naming the field; no
    replacement would get further."""
    for node in sorted(plan.nodes):
        pod = observed.pods.get(node)
        if pod is not None and pod.phase == "Failed" and pod.last_words:
            found = workload_termination(pod.last_words)
            if found is not None:
                return node, *found
    return None


def training_complete(plan: Plan, observed: Observation) -> bool:
    """Whether every node of the plan has finished training (all commit the same last step, so they end
    together; one that finished while another failed is handled as that failure)."""
    return bool(plan.nodes) and all(
        (pod := observed.pods.get(node)) is not None and pod.completed for node in plan.nodes
    )


def unconfirmed_copies(plan: Plan, stepped_generation: int | None, generation: int) -> set[int]:
    """Nodes of generation `generation`'s `plan` that hold nothing but what that generation copied to
    them (a joiner), while no step of it is known to have committed (`stepped_generation`: the newest
    generation a worker recorded a step under; None when none is known). A step commits on every rank or
    none, so one committed step says every copy arrived; before it, a failure can have cut a copy short
    (its source died mid-copy), and a plan that counted the joiner as a holder of its layers left the job
    waiting forever on layers nobody had (two quick kills of a two-node job hung it, Running and
    AllHealthy). The planner counts them as holding nothing (`replan`'s `emptied`).

    After a restart from the checkpoint (a plan of policy `checkpoint` past generation 0) every node holds
    only what it loads, and one that starts late reads the newest plan: a plan decided on top of the
    restart before a step confirmed it made a node that had not loaded the checkpoint yet skip it, holding
    nothing the next plan counted on (a join right after a restart: the restarted node could not send its
    layers, waited out its plan timeout and was replaced). Every node of such a plan is unconfirmed: the
    planner restarts from the checkpoint again, with the joiner in. Only when the steps are known, though:
    with `stepped_generation` None (unknown: Redis away or emptied before a restarted operator read a step),
    a joiner is still counted as holding nothing (copying its layers again costs little) but a restart's
    nodes are not (restarting again would cost every step since the checkpoint, perhaps hours of them)."""
    if stepped_generation is not None and stepped_generation >= generation:
        return set()
    if plan.policy is Policy.CHECKPOINT and generation > 0:
        return set(plan.nodes) if stepped_generation is not None else set()
    copied: dict[int, set[int]] = {}
    for transfer in plan.transfers:
        copied.setdefault(transfer.dst, set()).add(transfer.layer)
    held = plan.layers_by_node()
    return {node for node, layers in held.items() if layers and layers <= copied.get(node, set())}


def completed(
    status: api.ResilientJobStatus, published: PlanAnnouncement
) -> tuple[api.ResilientJobStatus, str]:
    """The status of a job whose workers all trained to the end under `published`, and what to tell. A
    fail-slow episode still open ends with the training: no node is slow in a job that runs no more (a
    Succeeded job went on listing its last slow node), and none works (it showed the workers counted alive
    by the last pass, as the pods completed one by one: `1/3`)."""
    message = f"training finished under generation {published.generation} ({published.layout})"
    conditions = set_condition(
        status.conditions, api.ConditionType.COMPLETE, True, api.Reason.TRAINING_COMPLETE, message
    )
    # As a completed pod's Ready: False, and why.
    exited = "the workers trained to the end and exited"
    conditions = set_condition(
        conditions, api.ConditionType.WORKERS_READY, False, api.Reason.TRAINING_COMPLETE, exited
    )
    update = {
        "phase": api.Phase.SUCCEEDED,
        "conditions": conditions,
        "slow_nodes": [],
        "workers_alive": 0,
        "workers": f"0/{status.workers_total}",
    }
    return status.model_copy(update=update), message


def lost_after_training(spec: api.ResilientJobSpec) -> tuple[str, str]:
    """The field and the line of a job whose every node failed after its last step committed (while the
    trained model, or the last checkpoint, was written): where the trained model is, if anywhere. Without
    `spec.checkpoint.volume` the checkpoints were in each pod's emptyDir, gone with the pods."""
    steps, saved = spec.training.steps, spec.checkpoint.path
    lost = f"every node failed after the last step ({steps}) committed"
    export = f"`rjob export {saved} --model {spec.model} --out DIR` (on spec.checkpoint.volume)"
    hf = model_source(spec.model) in (ModelSource.HF_DIRECTORY, ModelSource.HF_CONFIG, ModelSource.PROFILE)
    if not spec.checkpoint.volume:
        kept = "no checkpoint holds it: they were node-local (no spec.checkpoint.volume)"
        return (
            "spec.output.path" if spec.output is not None else "spec.checkpoint.volume"
        ), f"{lost}; {kept}"
    if spec.output is not None:
        return "spec.output.path", (
            f"{lost}, before the trained model was written whole; {export} writes it from the step {steps} "
            "checkpoint"
        )
    where = f"; {export} writes it as a Hugging Face model" if hf else ""
    return "spec.checkpoint.path", (
        f"{lost}, while its checkpoint was written: the newest complete step in {saved} is the trained model "
        f"or the one before it{where}"
    )


def detect_joins(plan: Plan, observed: Observation, parked: Iterable[int] = ()) -> set[int]:
    """Ready, healthy pods for nodes the plan does not use: replacement pods (new node ids beyond
    `spec.nodes`, `_capacity`) or returning nodes. Nodes parked by fail-slow mitigation come back through
    their recovery report, not here. A node the last decision already offered to the planner and that it
    left idle is in this set too: `new_joins` tells the two apart."""
    used = set(plan.nodes) | set(parked)
    return {
        node for node, pod in observed.pods.items() if node not in used and pod.ready and pod.failed is None
    }


def new_joins(idle: set[int], decided: Iterable[int]) -> set[int]:
    """The joins that call for a new decision: idle nodes the last generation did not already decide about
    (a scale-up the planner answered by leaving a node idle, the eq. 8 choice, is not asked again each
    pass; the idle node is offered again with the next change)."""
    return idle - set(decided)


def starting_nodes(plan: Plan, observed: Observation, parked: Iterable[int] = ()) -> set[int]:
    """Pods for nodes the plan does not use that are neither running nor failed yet: replacements waiting
    for the scheduler or still pulling their image. Once ready they are joins (`detect_joins`)."""
    used = set(plan.nodes) | set(parked)
    return {
        node
        for node, pod in observed.pods.items()
        if node not in used and not pod.ready and pod.failed is None and not pod.completed
    }


def held_joins(
    starting: set[int], stepped: int | None, generation: int, waited_s: float, settle_s: float
) -> str | None:
    """Why joins wait before a generation takes them in, or None when they go now. A join is never urgent
    (the job trains on without it) and every generation makes every worker rendezvous again, so joins wait,
    at most `settle_s` from when the first of them was ready (`waited_s`), for the replacements still
    `starting` (they then join in the same generation, not one generation each) and for the first committed
    step of the current `generation` (`stepped`: the newest generation a step was recorded under; None,
    unknown, holds nothing): a generation decided before that step counts the nodes the current one copied
    to or restarted as holding nothing, and restarts them again. Failures never wait, and take any ready
    join with them."""
    if waited_s >= settle_s:
        return None
    if starting:
        return f"nodes {sorted(starting)} are still starting"
    if stepped is not None and stepped < generation:
        return f"generation {generation} has not committed a step yet"
    return None


def measured_switches(
    recoveries: list[api.Recovery], switches: Mapping[int, tuple[float, float, int]]
) -> list[api.Recovery] | None:
    """The recoveries with what the workers measured of each one's switch (`TelemetryPass.switches`: the
    slowest rendezvous and copies, the bytes received); None when that changes nothing (no status patch)."""
    updated = [_with_switch(recovery, switches.get(recovery.generation)) for recovery in recoveries]
    return updated if updated != recoveries else None


def _with_switch(recovery: api.Recovery, measured: tuple[float, float, int] | None) -> api.Recovery:
    if measured is None:
        return recovery
    update = {
        "rendezvous_s": round(measured[0], 4),
        "copy_s": round(measured[1], 4),
        "copied_bytes": measured[2],
    }
    return recovery.model_copy(update=update)


def same_work(current: Plan, plan: Plan) -> bool:
    """Whether `plan` gives every node the work `current` gives it: the same pipelines (stages, layers,
    micro-batches, reroutes), the same all-reduce rounds and nothing to copy. Published as a generation, it
    would only make every worker rendezvous again (the planner keeps the layout when a joined node is not
    worth a reconfiguration, as `policy: reroute` always does)."""
    return (
        plan.microbatch_size == current.microbatch_size
        and plan.pipelines == current.pipelines
        and plan.allreduce_rounds == current.allreduce_rounds
        and not plan.transfers
    )


def declined_joins(current: PlanAnnouncement, plan: Plan, joins: Iterable[int], why: str) -> api.Decision:
    """The decision to leave joined nodes idle under the current generation (`plan` does the `same_work`)."""
    kept = plan.model_copy(update={"generation": current.generation})
    return decision(kept, api.Reason.NODE_JOINED, joins, why)


def decision(
    plan: Plan, trigger: api.Reason, nodes: Iterable[int], why: str, strategy: str = ""
) -> api.Decision:
    chosen = next((c for c in plan.candidates if c.layout == plan.layout and c.policy == plan.policy), None)
    reason = why
    if chosen is not None and chosen.reason:
        reason = f"{why}; {chosen.reason}"
    return api.Decision(
        generation=plan.generation,
        trigger=trigger,
        nodes=sorted(nodes),
        policy=str(plan.policy),
        layout=plan.layout,
        strategy=strategy,
        reason=reason,
        planning_s=round(plan.planning_s, 6),
        candidates=[
            api.CandidateStatus(
                policy=str(c.policy),
                layout=c.layout,
                step_time_s=round(c.step_time_s, 6),
                transition_s=round(c.transition_s, 6),
                score=round(c.score, 6),
                feasible=c.feasible,
                reason=c.reason,
            )
            for c in plan.candidates[:64]
        ],
        decided_at=now_rfc3339(),
    )


def explain(decision: api.Decision) -> str:
    """One line for the Event: what happened and why this plan won."""
    best = sorted((c for c in decision.candidates if c.feasible), key=lambda c: -c.score)[:3]
    ranked = "; ".join(
        f"{c.policy} {c.layout}: step {c.step_time_s:.3g}s, "
        f"transition {c.transition_s:.3g}s, score {c.score:.4g}"
        for c in best
    )
    # A generation for no node in particular (a world re-formed, a store replaced) names none.
    nodes = f" nodes [{','.join(str(n) for n in decision.nodes)}]" if decision.nodes else ""
    how = f"{decision.strategy} " if decision.strategy else ""
    plan = f"{how}{decision.policy} {decision.layout}"
    head = f"generation {decision.generation}: {decision.trigger}{nodes} -> {plan}"
    return f"{head} ({decision.reason})" + (f"; candidates (estimates): {ranked}" if ranked else "")


def set_condition(
    conditions: list[api.Condition], type_: api.ConditionType, status: bool, reason: api.Reason, message: str
) -> list[api.Condition]:
    """Replace the condition of this type where it stands (`kubectl describe` keeps its order), or add it
    last; keep its transition time when its status did not change."""
    flag = "True" if status else "False"
    old = next((c for c in conditions if c.type == type_), None)
    when = old.last_transition_time if old is not None and old.status == flag else now_rfc3339()
    new = api.Condition(
        type=type_, status=flag, reason=reason, message=message[:32768], last_transition_time=when
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


def telemetry_condition(
    conditions: list[api.Condition],
    redis_down: bool,
    outage: BaseException | None = None,
    back_after_s: float | None = None,
) -> list[api.Condition]:
    """Whether the status's telemetry is current: False while Redis is away (the throughput, step and loss
    are as of its last answer: a user saw a Running job with fresh-looking figures through an outage), True
    once it answers again. Level-triggered: the conditions unchanged when they already say so (no write),
    and none added to a job that never lost Redis; a False left by an operator that restarted during an
    outage turns True with the first pass that finds Redis back."""
    old = next((c for c in conditions if c.type == api.ConditionType.TELEMETRY_CURRENT), None)
    if (old is None and not redis_down) or (old is not None and (old.status == "False") == redis_down):
        return conditions
    if not redis_down:
        back = "Redis answers again" + (f" after {back_after_s:.1f} s" if back_after_s is not None else "")
        return set_condition(
            conditions, api.ConditionType.TELEMETRY_CURRENT, True, api.Reason.REDIS_AVAILABLE, back
        )
    cause = type(outage).__name__ if outage is not None else "no answer"
    message = (
        f"Redis unreachable ({cause}): throughput, step and loss are as of its last answer; the workers "
        "train on, and failed pods are still replanned around"
    )
    return set_condition(
        conditions, api.ConditionType.TELEMETRY_CURRENT, False, api.Reason.REDIS_UNAVAILABLE, message
    )


def plan_status(
    status: api.ResilientJobStatus, plan: Plan, alive: int, parked: Iterable[int] = ()
) -> api.ResilientJobStatus:
    """The status fields that follow from the published plan (parked slow nodes are not failed ones)."""
    total = len(plan.nodes)
    out = sorted(parked)
    return status.model_copy(
        update={
            "plan_generation": plan.generation,
            "layout": plan.layout,
            "policy": str(plan.policy),
            "failed_nodes": sorted(set(plan.failed_nodes) - set(out)),
            "parked_nodes": out,
            "workers_alive": alive,
            "workers_total": total,
            "workers": f"{alive}/{total}",
            "estimated_throughput": round(plan.throughput, 3),
        }
    )


def still_fenced(fenced: Iterable[int], message: PlanAnnouncement) -> list[int]:
    """The fenced nodes a generation does not take back (a node in its layout or parked is back)."""
    back = set(message.plan.nodes) | set(message.parked)
    return sorted({int(n) for n in fenced} - back)


@dataclass(frozen=True, slots=True)
class Applied:
    """What a committed generation makes of the status, and the decision its Event tells."""

    status: api.ResilientJobStatus
    decision: api.Decision
    trigger: api.Reason
    first: bool
    """Generation 0 of the job: planned, not a recovery."""


def applied(status: api.ResilientJobStatus, message: PlanAnnouncement, alive: int, wanted: int) -> Applied:
    """The status once `message` is applied, with `alive` of its nodes' pods running and `wanted` worker
    pods asked for (`spec.nodes`): the plan's fields, the decision, the Planned and Degraded conditions,
    the fenced nodes it takes back, and a recovery row for every generation after the first."""
    first = status.plan_generation < 0
    planned = plan_status(status, message.plan, alive, message.parked)
    trigger = api.Reason(message.trigger) if message.trigger in set(api.Reason) else api.Reason.REPLANNED
    chosen = decision(message.plan, trigger, message.nodes, message.reason, message.strategy)
    conditions = set_condition(
        planned.conditions,
        api.ConditionType.PLANNED,
        True,
        api.Reason.PLANNED,
        f"generation {message.generation}",
    )
    # Failed nodes whose places replacements took (`_capacity`) no longer degrade the job.
    degraded = (bool(message.plan.failed_nodes) and len(message.plan.nodes) < wanted) or bool(message.parked)
    conditions = set_condition(
        conditions,
        api.ConditionType.DEGRADED,
        degraded,
        trigger if degraded else api.Reason.ALL_HEALTHY,
        f"failed nodes {sorted(message.plan.failed_nodes)}" if degraded else "every node in use",
    )
    update: dict[str, Any] = {
        "last_decision": chosen,
        "conditions": conditions,
        "phase": api.Phase.RUNNING,
        "fenced_nodes": still_fenced(planned.fenced_nodes, message),
    }
    if not first:
        recovery = api.Recovery(
            generation=message.generation,
            trigger=trigger,
            nodes=list(message.nodes),
            policy=message.policy,
            layout=message.layout,
            strategy=message.strategy,
            detect_s=message.detect_s,
            onset_step=message.onset_step,
            detected_step=message.detected_step,
            plan_s=round(message.plan.planning_s, 6),
            at=chosen.decided_at,
        )
        update["recoveries"] = [*planned.recoveries, recovery][-api.RECOVERY_HISTORY :]
    return Applied(planned.model_copy(update=update), chosen, trigger, first)
