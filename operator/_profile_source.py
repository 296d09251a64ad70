"""Where a job's layer profile comes from when the operator must read it: a ConfigMap the spec references
(`spec.profile.configMapRef`), or node 0's agent (`agent/_model_profile.py` is its side).

Only a pod can make the profile of an `hf:<dir>` model given without one (its config.json is on a volume of
the pods) and of `spec.profile.measure` (the layers are timed on the job's own devices), so the planner has
nothing to plan generation 0 with. The controller then creates the job's pods without a plan (generation
annotation -1, condition `Planned=False` reason `WaitingForProfile`), sets a `ModelProfileRequest` in Redis
and waits for node 0's `ModelProfileReport`. A report is decoded like every message (size-bounded, validated),
must answer this job's request, and its profile must have the layer count of the model the runtime built; a
failed one (node 0 could not read the config, an unsupported family) fails the job naming why
(`ProfileFailed`). Node 0's pod is re-created if it fails or goes away before it answers, up to
`NODE0_FAILURES` failures.

The accepted profile is stored in the ConfigMap `<job>-profile`, owned by the job: the durable record, so a
restarted operator or an emptied Redis never needs node 0 again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

import yaml
from redis.exceptions import RedisError

from resilientjob.agent._model_profile import PROFILE_NODE, report_key, request_key
from resilientjob.agent.telemetry_messages import (
    MAX_PROFILE_BYTES,
    ModelProfileReport,
    ModelProfileRequest,
    decode,
    encode,
)
from resilientjob.planner._errors import PlannerError
from resilientjob.planner.profile import ModelProfile

from . import _decide, _manifests, api
from ._kube import KubeApi, core_path
from ._planning import profile_from_pod

if TYPE_CHECKING:
    import kopf

    from .reconciler import JobController

log = logging.getLogger("resilientjob.operator")


def profile_request(spec: api.ResilientJobSpec) -> ModelProfileRequest:
    """What node 0 must profile: the model as the pods build it (their sequence length), per micro-batch."""
    return ModelProfileRequest(
        model=spec.model,
        seq_len=_manifests.workload(spec).data.seq_len,
        microbatch_size=spec.micro_batch_size,
        measure=spec.profile is not None and spec.profile.measure,
    )


def _field(request: ModelProfileRequest) -> str:
    """The field a failure to make the profile is charged to."""
    return "spec.profile.measure" if request.measure else "spec.model"


def accepted_profile(report: ModelProfileReport) -> ModelProfile:
    """The report's profile; PlannerError naming the field when node 0 failed or the profile does not fit."""
    field = _field(report.request)
    if report.profile is None:
        raise PlannerError(field, f"node {report.node} could not make the profile: {report.error}")
    if report.profile.num_layers != report.num_layers:
        raise PlannerError(
            field,
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
    text = ((configmap or {}).get("data") or {}).get(ref.key)
    if text is None:
        raise PlannerError("spec.profile.configMapRef", f"ConfigMap {ref.name!r} has no key {ref.key!r}")
    try:
        decoded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlannerError("spec.profile.configMapRef", f"not valid JSON/YAML: {exc}") from None
    if not isinstance(decoded, dict):
        raise PlannerError("spec.profile.configMapRef", "must hold a mapping with a 'layers' list")
    return decoded


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


async def _store(ctl: JobController, profile: ModelProfile, source: str) -> None:
    manifest = _manifests.profile_configmap(ctl.body, profile.model_dump_json(), source)
    if not await ctl.kube.create(core_path(ctl.namespace, "configmaps"), manifest):
        path = core_path(ctl.namespace, "configmaps", manifest["metadata"]["name"])
        await ctl.kube.patch(path, {"data": manifest["data"]})


async def _announce(ctl: JobController, how: str) -> None:
    """The status while the pods run without a plan: valid, not planned (named reason), and an Event."""
    message = f"waiting for the model's profile: {how}"
    conditions = _decide.set_condition(
        ctl.status.conditions, api.ConditionType.VALID, True, api.Reason.SPEC_VALID, "spec accepted"
    )
    conditions = _decide.set_condition(
        conditions, api.ConditionType.PLANNED, False, api.Reason.WAITING_FOR_PROFILE, message
    )
    ctl.status = ctl.status.model_copy(update={"conditions": conditions})
    await ctl.write_status(force=True)
    ctl.event("Normal", api.Reason.WAITING_FOR_PROFILE, message)


NODE0_FAILURES = 3
"""Node 0's pod may fail this often before it reports (a lost machine, an eviction); then the job fails: an
agent that cannot even load the model dies before it can answer, every time."""


async def _keep_node0(ctl: JobController, failed_pods: set[str], field: str) -> None:
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
                    f"{pod.failed}); its log says why",
                )
            cause = f"node 0: {pod.failed} before it reported the profile; re-created"
            ctl.event("Warning", api.Reason.WAITING_FOR_PROFILE, cause)
        await ctl.kube.delete(core_path(ctl.namespace, "pods", pod.name), grace_period_s=0)
        ctl.pods.pop(PROFILE_NODE, None)
    await ctl.create_pods([PROFILE_NODE], generation=-1, layout="")


async def _exchange(ctl: JobController, request: ModelProfileRequest) -> ModelProfileReport | None:
    """Keep the request in Redis (an emptied Redis gets it again) and read the answer to it, if any."""
    if ctl.redis is None:
        raise RuntimeError("JobController.setup() must succeed first")
    client, keys = ctl.redis.client, ctl.redis.keys
    wanted = encode(request)
    if await client.get(request_key(keys)) != wanted:
        await client.set(request_key(keys), wanted)
    raw = await client.get(report_key(keys))
    report = decode(ModelProfileReport, raw, "operator.profile_report", MAX_PROFILE_BYTES)
    return report if report is not None and report.request == request else None


async def wait_for_profile(ctl: JobController, stopped: kopf.DaemonStopped) -> dict[str, Any] | None:
    """Pods up without a plan until node 0 reports the profile; the profile (decoded, stored), or None when
    the job stopped first. Raises PlannerError naming the field when node 0 could not make it."""
    spec = ctl.require_spec()
    request = profile_request(spec)
    how = "measures its layers" if request.measure else "computes it from the model's config.json"
    await ctl.create_pods(range(spec.nodes), generation=-1, layout="")
    await _announce(ctl, f"node 0 {how}")
    failed_pods: set[str] = set()
    while not stopped:
        try:
            report = await _exchange(ctl, request)
        except (RedisError, OSError) as exc:
            log.warning("job %s/%s: redis unavailable (%r); retrying", ctl.namespace, ctl.name, exc)
            report = None
        if report is not None:
            profile = accepted_profile(report)
            source = "measured" if report.measured else "computed"
            await _store(ctl, profile, source)
            ctl.event(
                "Normal",
                api.Reason.PROFILE_REPORTED,
                f"node {report.node} {source} the profile: {profile.num_layers} layers; kept in ConfigMap "
                f"{_manifests.profile_configmap_name(ctl.name)}",
            )
            return profile.model_dump(mode="json")
        await _keep_node0(ctl, failed_pods, _field(request))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctl.wakeup.wait(), ctl.settings.poll_interval_s)
        ctl.wakeup.clear()
    return None
