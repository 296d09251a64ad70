"""Node 0's pre-flight before the first plan (`agent/_model_profile.py` is its side), and where a job's
layer profile comes from when the operator must read it: a ConfigMap the spec references
(`spec.profile.configMapRef`), or node 0's agent.

The model's checkpoint and the data of a job the runtime trains live on volumes of the pods, which the
operator cannot read; so does the config.json of an `hf:<dir>` model given without a profile, and
`spec.profile.measure` times the layers on the job's own devices. The controller then creates the job's pods
without a plan (generation annotation -1, condition `Planned=False` reason `CheckingWorkload`, or
`WaitingForProfile` when it needs the profile), sets a `ModelProfileRequest` in Redis and waits for node 0's
`ModelProfileReport`. A report is decoded like every message (size-bounded, validated) and must answer this
job's request. A failed one (a missing model directory, an unsupported family, a tensor missing from the
checkpoint, data shorter than one sample, a token id beyond the vocabulary) fails the job naming the field
(`Valid=False`, reason `InvalidWorkload`) and deletes its pods before any worker trains; a profile that does
not fit the model fails it with `ProfileFailed`. Node 0's pod is re-created if it fails or goes away before it
answers, up to `NODE0_FAILURES` failures.

An accepted profile is stored in the ConfigMap `<job>-profile`, owned by the job: the durable record, so a
restarted operator or an emptied Redis never needs node 0 again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.profile import ModelProfile
from resilientjob.protocol.messages import (
    MAX_PROFILE_BYTES,
    PROFILE_NODE,
    ModelProfileReport,
    ModelProfileRequest,
    decode,
    encode,
)

from . import _decide, _manifests, api
from ._job_view import JobView
from .kube import KubeApi, core_path
from .planning import checked_by_node0, configmap_profile, profile_from_pod, profile_request

if TYPE_CHECKING:
    import kopf


log = logging.getLogger("resilientjob.operator")


class WorkloadRejected(PlannerError):
    """Node 0 found the model or the data unusable: the spec names something that cannot train."""


def needs_preflight(spec: api.ResilientJobSpec, has_inputs: bool) -> bool:
    """Whether node 0 must answer before the first plan: it checks every job the runtime trains, and makes
    the profile only a pod can make (`has_inputs` False)."""
    return checked_by_node0(spec) or not has_inputs


def _field(request: ModelProfileRequest) -> str:
    """The field a profile that does not fit is charged to."""
    return "spec.profile.measure" if request.measure else "spec.model"


def accepted_profile(report: ModelProfileReport) -> ModelProfile | None:
    """The report's profile (None when none was asked for). WorkloadRejected naming the field when node 0
    failed; PlannerError when the profile does not fit the model node 0 built."""
    if report.error:
        raise WorkloadRejected(report.error_field, f"{report.error} (found by node {report.node})")
    if report.profile is None:
        return None
    if report.profile.num_layers != report.num_layers:
        raise PlannerError(
            _field(report.request),
            f"node {report.node}'s profile has {report.profile.num_layers} layers but the model it built "
            f"has {report.num_layers}",
        )
    return report.profile


async def referenced_profile(
    kube: KubeApi, namespace: str, job: str, spec: api.ResilientJobSpec
) -> dict[str, Any] | None:
    """The decoded profile of `spec.profile.configMapRef`, or the one node 0 made earlier (if any) for a job
    whose profile only a pod can make; None otherwise. PlannerError naming the field for a bad reference."""
    ref = spec.profile.config_map_ref if spec.profile is not None else None
    if ref is None:
        return await stored_profile(kube, namespace, job) if profile_from_pod(spec) else None
    configmap = await kube.get(core_path(namespace, "configmaps", ref.name))
    return configmap_profile(configmap, ref)


async def stored_profile(kube: KubeApi, namespace: str, job: str) -> dict[str, Any] | None:
    """The profile kept in the job's profile ConfigMap (decoded), or None when there is none yet."""
    name = _manifests.profile_configmap_name(job)
    configmap = await kube.get(core_path(namespace, "configmaps", name))
    text = ((configmap or {}).get("data") or {}).get(_manifests.PROFILE_KEY)
    if text is None:
        return None
    try:
        decoded = json.loads(text)
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        # Hand-edited into garbage: ask node 0 again rather than plan with it.
        log.warning("job %s/%s: ConfigMap %s holds no profile; asking node 0 again", namespace, job, name)
        return None
    return decoded


async def _store(ctl: JobView, profile: ModelProfile, source: str) -> None:
    manifest = _manifests.profile_configmap(ctl.body, profile.model_dump_json(), source)
    if not await ctl.kube.create(core_path(ctl.namespace, "configmaps"), manifest):
        path = core_path(ctl.namespace, "configmaps", manifest["metadata"]["name"])
        await ctl.kube.patch(path, {"data": manifest["data"]})


async def _announce(ctl: JobView, request: ModelProfileRequest) -> None:
    """The status while the pods run without a plan: valid, not planned (named reason), and an Event."""
    if request.profile:
        how = "measures its layers" if request.measure else "computes it from the model's configuration"
        reason, message = api.Reason.WAITING_FOR_PROFILE, f"waiting for the model's profile: node 0 {how}"
    else:
        reason, message = api.Reason.CHECKING_WORKLOAD, "node 0 checks the model and the data"
    conditions = _decide.set_condition(
        ctl.status.conditions, api.ConditionType.VALID, True, api.Reason.SPEC_VALID, "spec accepted"
    )
    conditions = _decide.set_condition(conditions, api.ConditionType.PLANNED, False, reason, message)
    ctl.status = ctl.status.model_copy(update={"conditions": conditions})
    await ctl.write_status(force=True)
    ctl.event("Normal", reason, message)


NODE0_FAILURES = 3
"""Node 0's pod may fail this often before it reports (a lost machine, an eviction); then the job fails: an
agent that cannot even load the model dies before it can answer, every time."""


async def _keep_node0(ctl: JobView, failed_pods: set[str], field: str) -> None:
    """Node 0 must be up to answer: re-create its pod when it failed or is gone; PlannerError naming `field`
    once it failed NODE0_FAILURES times (counted by pod uid: the watch may repeat an old pod's events)."""
    pod = ctl.pods.get(PROFILE_NODE)
    if pod is not None and pod.failed is None:
        return
    if pod is not None:
        if pod.uid not in failed_pods:
            failed_pods.add(pod.uid)
            if len(failed_pods) >= NODE0_FAILURES:
                raise PlannerError(
                    field,
                    f"node 0's pod failed {len(failed_pods)} times before it reported the profile (last: "
                    f"{pod.failed})",
                )
            cause = f"node 0: {pod.failed} before it reported the profile; re-created"
            ctl.event("Warning", api.Reason.WAITING_FOR_PROFILE, cause)
        await ctl.kube.delete(core_path(ctl.namespace, "pods", pod.name), grace_period_s=0)
        ctl.pods.pop(PROFILE_NODE, None)
    await ctl.create_pods([PROFILE_NODE], generation=-1, layout="")


async def _exchange(ctl: JobView, request: ModelProfileRequest) -> ModelProfileReport | None:
    """Keep the request in Redis (an emptied Redis gets it again) and read the answer to it, if any."""
    if ctl.redis is None:
        raise RuntimeError("JobController.setup() must succeed first")
    client, keys = ctl.redis.client, ctl.redis.keys
    wanted = encode(request)
    if await client.get(keys.profile_request) != wanted:
        await client.set(keys.profile_request, wanted)
    raw = await client.get(keys.profile_report)
    report = decode(ModelProfileReport, raw, "operator.profile_report", MAX_PROFILE_BYTES)
    return report if report is not None and report.request == request else None


async def preflight(ctl: JobView, stopped: kopf.DaemonStopped) -> ModelProfileReport | None:
    """Pods up without a plan until node 0 reports; its report (accepted, its profile stored), or None when
    the job stopped first. Raises WorkloadRejected or PlannerError naming the field when node 0 found the
    workload unusable or its profile does not fit."""
    spec = ctl.require_spec()
    request = profile_request(spec, has_inputs=ctl.inputs is not None)
    await ctl.create_pods(range(spec.nodes), generation=-1, layout="")
    await _announce(ctl, request)
    failed_pods: set[str] = set()
    while not stopped:
        wait = ctl.settings.poll_interval_s
        try:
            report = await _exchange(ctl, request)
            ctl.watch.ok()
        except (RedisError, OSError) as exc:
            wait = max(wait, ctl.watch.failed(exc))  # backoff, one log line per outage
            report = None
        if report is not None:
            profile = accepted_profile(report)
            given = ctl.inputs.profile.num_layers if ctl.inputs is not None else report.num_layers
            if given != report.num_layers:
                raise WorkloadRejected(
                    "spec.profile" if spec.profile is not None else "spec.model",
                    f"the profile has {given} layers but node {report.node} built {spec.model} with "
                    f"{report.num_layers}",
                )
            if profile is None:
                checked = f"node {report.node} checked the model and the data"
                ctl.event("Normal", api.Reason.SPEC_VALID, checked)
                return report
            source = "measured" if report.measured else "computed"
            await _store(ctl, profile, source)
            ctl.event(
                "Normal",
                api.Reason.PROFILE_REPORTED,
                f"node {report.node} {source} the profile: {profile.num_layers} layers; kept in ConfigMap "
                f"{_manifests.profile_configmap_name(ctl.name)}",
            )
            return report
        await _keep_node0(ctl, failed_pods, "spec.profile.measure" if request.measure else "spec.model")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctl.wakeup.wait(), wait)
        ctl.wakeup.clear()
    return None
