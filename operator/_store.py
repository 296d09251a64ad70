"""Keeps a job's store pod (`<job>-store`, `_manifests.store_pod_manifest`) in existence while the job runs.

A job that trains through the runtime keeps its TCPStore in a pod of its own, so that no worker pod is
special (issue #14: a store inside a worker pod died with that pod and took the job with it). The operator
creates the store pod with the worker pods and creates it again when it is gone or Failed; the new host
republishes the committed plan from Redis and the workers reconnect to it (`agent._store_client`). A store
outage longer than the collective timeout makes the workers abandon the step they were in, waiting for a
newer generation, so once a store pod was replaced (or its container restarted in place) the operator
commits the same layout again as the next generation (`rendezvous_again`): every worker re-rendezvouses on
the new store through the ordinary reconfiguration path, copying nothing and losing no committed step.
A synthetic job has no store and gets no store pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resilientjob.planner.plan import Policy, Transfer
from resilientjob.protocol.messages import PlanAnnouncement
from resilientjob.protocol.models import ModelSource, model_source

from . import _manifests, api
from ._redis_state import announcement
from ._worker_defaults import load_worker_defaults
from .kube import KubeApi, core_path


def needs_store(spec: api.ResilientJobSpec) -> bool:
    """Whether the job trains through the runtime (which rendezvous through the store)."""
    try:
        return model_source(spec.model) is not ModelSource.SYNTHETIC
    except ValueError:
        return False  # an unknown model is rejected elsewhere, naming the field


def is_store_pod(pod: Mapping[str, Any], job: str) -> bool:
    """Whether `pod` is job `job`'s store pod: its job label holds the name as a label value (hashed past
    63 characters, `_manifests.job_label`)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    role = labels.get(_manifests.LABEL_ROLE)
    return labels.get(_manifests.LABEL_JOB) == _manifests.job_label(job) and role == _manifests.ROLE_STORE


def rendezvous_again(
    current: PlanAnnouncement,
    trigger: api.Reason = api.Reason.REPLANNED,
    reason: str = "the job's store pod was replaced: the workers rendezvous again on the new store",
    detect_s: float = 0.0,
    transfers: tuple[Transfer, ...] | None = None,
    restart_again: bool = False,
) -> PlanAnnouncement:
    """The committed layout again as the next generation: for workers whose store was replaced, or whose
    world stopped on a communication error with every node alive (`_aborts`). `dynamic`: every node keeps
    its layers (a `checkpoint` plan would reload the last checkpoint for nothing). `transfers`: the layer
    copies the next generation carries again (`_aborts.copies_to_carry`: none once every worker got past
    them, so that a node that only sent layers, whose worker has left, is not waited for at its
    rendezvous); None: the current generation's, all of them. `restart_again`: the current generation is
    a restart from the checkpoint whose switch failed: the next one restarts again (as `dynamic` the nodes
    whose restore had not completed would train on what they hold)."""
    # No planner ran: the previous decision's candidates and planning time are not this one's.
    update: dict[str, object] = {
        "generation": current.generation + 1,
        "policy": Policy.CHECKPOINT if restart_again else Policy.DYNAMIC,
        "candidates": (),
        "planning_s": 0.0,
    }
    if transfers is not None:
        update["transfers"] = transfers
    plan = current.plan.model_copy(update=update)
    return announcement(
        plan,
        trigger=trigger,
        reason=reason,
        detect_s=detect_s,
        parked=current.parked,
        restore=current.restore,
    )


def _restarts(pod: Mapping[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount") or 0) for s in statuses if isinstance(s, Mapping))


class StoreKeeper:
    """One job's store pod: `observe` its pod events, `ensure` it exists (cheap unless an event or the first
    call said it may be gone)."""

    def __init__(self, kube: KubeApi, namespace: str, job: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.job = job
        self.check_due = True
        self.created = 0
        """Store pods this keeper created (the first one included)."""
        self.replaced = False
        """A store pod was replaced or restarted since the last `rendezvous_again` (the caller clears it)."""
        self._restarts: dict[str, int] = {}
        self._had_one = False

    def observe(self, pod: Mapping[str, Any], deleted: bool) -> bool:
        """Note an event of any pod; True when it was the job's store pod (the caller wakes its loop)."""
        if not is_store_pod(pod, self.job):
            return False
        phase = (pod.get("status") or {}).get("phase")
        if deleted or phase == "Failed" or (pod.get("metadata") or {}).get("deletionTimestamp"):
            self.check_due = True
        uid, restarts = str((pod.get("metadata") or {}).get("uid") or ""), _restarts(pod)
        if uid in self._restarts and restarts > self._restarts[uid]:
            self.replaced = True  # its container restarted in place: a new, empty store at the same address
        self._restarts = {uid: restarts}
        return True

    async def ensure(
        self,
        body: Mapping[str, Any],
        spec: api.ResilientJobSpec,
        redis_url: str,
        worker_defaults: str | None = None,
    ) -> None:
        """Create the store pod if it is missing; delete a Failed one (its replacement follows once it is
        gone). A Succeeded one stays: its host stops only after the job's last step."""
        if not self.check_due or not needs_store(spec):
            return
        existing = await self.kube.get(core_path(self.namespace, "pods", _manifests.store_pod_name(self.job)))
        if existing is not None:
            self._had_one = True
            failed = (existing.get("status") or {}).get("phase") == "Failed"
            deleting = bool((existing.get("metadata") or {}).get("deletionTimestamp"))
            if failed and not deleting:
                await self.kube.delete(core_path(self.namespace, "pods", _manifests.store_pod_name(self.job)))
            self.check_due = failed or deleting
            return
        manifest = _manifests.store_pod_manifest(body, spec, redis_url)
        if worker_defaults:
            # The chart's settings that let a pod run beside the workers, without the accelerator's.
            manifest = load_worker_defaults(worker_defaults).apply(manifest, worker=False)
        if await self.kube.create(core_path(self.namespace, "pods"), manifest):
            self.created += 1
            self.replaced = self.replaced or self._had_one
            self._had_one = True
        self.check_due = False
