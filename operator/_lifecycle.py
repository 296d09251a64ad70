"""A job's daemon at its start: does anything of the job still need running, and is an earlier job of the
same name out of the way?

An ended job stays ended (`ended`). An operator that restarts (an upgrade, a failover) starts a daemon for
every job, ended ones too; it ran a failed job's pre-flight or generation again on each restart, and gave a
succeeded one a store pod that waited for steps forever.

An earlier job's objects, still being deleted, are not this job's (`earlier_job_gone`). Deleting a job
deletes its pods, ConfigMaps and Service in the background (garbage collection by owner), and a pod takes
its grace period to go. A job applied again under the same name right away (the way to change a spec, which
is immutable) found them under its own names: it took the old terminating pods for its own and fenced every
node at generation 0, restored the old job's plan and profile from their ConfigMaps against its new spec,
and its `create` of the Service met the old one. What it finds is named by owner uid, and by the labels
this operator gives a job's objects: an earlier job's objects orphaned by `kubectl delete --cascade=orphan`
(no owner any more) are waited for too, with a Warning saying how to delete them, as nothing else will;
the new job took them for its own, its first decision fencing the old agents as they left. Objects a user
made under those names without the operator's labels are left alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from . import _capacity, _decide, _manifests, api
from ._job_view import JobView
from ._pods import WorkerPods
from .kube import KubeApi, core_path

log = logging.getLogger("resilientjob.operator")


class JobEnded(Exception):
    """The job failed before this daemon started; its message says why (its failed condition)."""


async def ended(ctl: JobView, workers: WorkerPods) -> bool:
    """Whether the job ended before this daemon started: nothing of it runs again. A succeeded job's pods
    stay for their logs (True). A failed job's pods are deleted, in case its failure was cut short before
    they went, and JobEnded says why it failed."""
    if ctl.status.phase == api.Phase.SUCCEEDED:
        log.info("job %s/%s: succeeded before; nothing to run", ctl.namespace, ctl.name)
        return True
    if ctl.status.phase != api.Phase.FAILED:
        return False
    await workers.delete_all()
    failed = [c for c in ctl.status.conditions if c.status == "False" and c.message]
    raise JobEnded(failed[0].message if failed else "the job failed before")


async def earlier_job_gone(ctl: JobView, uid: str, stopped: kopf.DaemonStopped) -> bool:
    """Wait while an earlier job of this name is still being deleted (`leftovers`), saying so once in an
    Event; False when stopped meanwhile. Only before the first plan: later, the job's own objects are all
    it finds. A pod of it stuck terminating is force-deleted (`stuck`)."""
    said = ""  # what the Event said: "owned", or "orphans" once some need deleting by hand
    forced: set[str] = set()
    while not stopped and ctl.status.plan_generation < 0 and uid:
        found = await leftovers(ctl.kube, ctl.namespace, ctl.name, uid)
        if not found:
            return True
        orphans = [leftover.name for leftover in found if leftover.orphaned]
        if not said or (orphans and said != "orphans"):
            said = "orphans" if orphans else "owned"
            await _say_waiting(ctl, found, orphans)
        for leftover in found:
            pod = leftover.name.removeprefix("pod/")
            if pod == leftover.name or pod in forced:
                continue
            if stuck(leftover.obj, time.time(), ctl.settings.leftover_grace_s):
                forced.add(pod)
                await ctl.kube.delete(core_path(ctl.namespace, "pods", pod), grace_period_s=0)
                message = (
                    f"force-deleted {leftover.name} of an earlier job of this name: still terminating "
                    f"{ctl.settings.leftover_grace_s:.0f} s after its grace period ended (its node is gone?)"
                )
                log.warning("job %s/%s: %s", ctl.namespace, ctl.name, message)
                ctl.event("Warning", api.Reason.WAITING_FOR_EARLIER_JOB, message)
        await stopped.wait(1.0)
    return not stopped


ORPHANS_NAMED = 8
"""Orphans named one by one in the `kubectl delete` the Warning gives; more are deleted by the job's label
(an Event's message is cut at 1024 characters, and the command must survive whole)."""


def delete_command(namespace: str, job: str, orphans: list[str]) -> str:
    """The `kubectl delete` of an earlier job's orphans: by name, or by the job's label when many."""
    targets = (
        " ".join(orphans)
        if len(orphans) <= ORPHANS_NAMED
        else f"pods,configmaps,services -l {_manifests.job_selector(job)}"
    )
    return f"kubectl delete -n {namespace} {targets}"


async def _say_waiting(ctl: JobView, found: list[Leftover], orphans: list[str]) -> None:
    """An Event, and with orphans (which only a user's delete takes away, however long the job waits) the
    Planned condition too, which outlives Events (about an hour): what the job waits for, and the command
    that deletes the orphans."""
    names = ", ".join(leftover.name for leftover in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    message = f"waiting for an earlier job of this name to be deleted: {len(found)} objects ({names}{more})"
    if orphans:
        message += (
            f"; {len(orphans)} of them orphaned (deleted with --cascade=orphan), which nothing deletes: "
            f"`{delete_command(ctl.namespace, ctl.name, orphans)}`"
        )
        conditions = _decide.set_condition(
            ctl.status.conditions,
            api.ConditionType.PLANNED,
            False,
            api.Reason.WAITING_FOR_EARLIER_JOB,
            message,
        )
        ctl.status = ctl.status.model_copy(update={"conditions": conditions})
        await ctl.write_status(force=True)
    log.info("job %s/%s: %s", ctl.namespace, ctl.name, message)
    ctl.event("Warning" if orphans else "Normal", api.Reason.WAITING_FOR_EARLIER_JOB, message)


def stuck(pod: Mapping[str, Any], now: float, grace_s: float) -> bool:
    """Whether a pod being deleted is `grace_s` past the end of its grace period (its `deletionTimestamp`):
    its node is gone and no kubelet will confirm it, so only a forced delete (grace 0, as `kubectl delete
    --force`) takes it out. A finalizer on it is left to whoever set it."""
    stamp = (pod.get("metadata") or {}).get("deletionTimestamp")
    ends = _capacity.unix_time(str(stamp)) if stamp else None
    return ends is not None and now - ends >= grace_s


def _foreign(obj: Mapping[str, Any] | None, uid: str) -> bool:
    """Whether `obj` is owned by a ResilientJob other than the one of `uid`."""
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(
        isinstance(ref, Mapping) and ref.get("kind") == api.KIND and ref.get("uid") not in (None, "", uid)
        for ref in refs
    )


def _orphaned(obj: Mapping[str, Any] | None, job: str) -> bool:
    """Whether `obj` is one this operator made for a job named `job` (its labels) that no ResilientJob owns
    any more: an earlier job's, orphaned by `kubectl delete --cascade=orphan`."""
    metadata = (obj or {}).get("metadata") or {}
    labels = metadata.get("labels") or {}
    ours = all(labels.get(key) == value for key, value in _manifests.job_labels(job).items())
    refs = metadata.get("ownerReferences") or []
    return ours and not any(isinstance(ref, Mapping) and ref.get("kind") == api.KIND for ref in refs)


@dataclass(frozen=True, slots=True)
class Leftover:
    """An object under this job's names that an earlier job of the name owns."""

    name: str
    """`kind/name`."""
    obj: Mapping[str, Any]
    orphaned: bool = False
    """Owned by no job (`_orphaned`): only a user's delete takes it away."""


async def leftovers(kube: KubeApi, namespace: str, job: str, uid: str) -> list[Leftover]:
    """The objects under job `job`'s names that another job (an earlier one of the same name) owns, or
    owned before it was deleted with `--cascade=orphan`."""
    objects: dict[str, Mapping[str, Any] | None] = {
        f"pod/{pod['metadata']['name']}": pod
        for pod in await kube.list(core_path(namespace, "pods"), _manifests.job_selector(job))
    }
    objects |= {
        f"configmap/{_manifests.plan_configmap_name(job)}": await kube.get(
            core_path(namespace, "configmaps", _manifests.plan_configmap_name(job))
        ),
        f"configmap/{_manifests.profile_configmap_name(job)}": await kube.get(
            core_path(namespace, "configmaps", _manifests.profile_configmap_name(job))
        ),
        f"service/{_manifests.service_name(job)}": await kube.get(
            core_path(namespace, "services", _manifests.service_name(job))
        ),
    }
    found = [(name, obj, _orphaned(obj, job)) for name, obj in objects.items() if obj is not None]
    return [Leftover(name, obj, orphan) for name, obj, orphan in found if orphan or _foreign(obj, uid)]
