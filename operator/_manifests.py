"""The Kubernetes objects the operator creates for a job, as plain dicts (pure functions, no I/O): a headless
Service, the plan ConfigMap, one Pod per node and, for a job that trains through the runtime, the store pod
that hosts the job's TCPStore (`agent.store_host`), all owned by the ResilientJob so that deleting the job
deletes them."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from resilientjob.protocol.messages import PlanAnnouncement
from resilientjob.protocol.workload import (
    WORKLOAD_ENV,
    DataFormat,
    DataSpec,
    Workload,
    WorkloadCheckpoint,
)

from . import api
from ._api_pods import apply_overrides
from .names import SUBDOMAIN_MAX, fit

LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB = "resilientjob.io/job"
LABEL_NODE = "resilientjob.io/node"
LABEL_ROLE = "resilientjob.io/role"
"""`store` on the job's store pod (which has no node label: fencing and planning never see it)."""
ROLE_STORE = "store"
STORE_COMMAND = ["python", "-m", "resilientjob.agent.store_host"]
STORE_PORT = 29500
"""The port of the job's TCPStore in the store pod (the headless Service's `rendezvous` port)."""
STORE_RESOURCES = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
"""The store pod's own size: one Python process with torch imported (~300 MiB on the CPU wheel; more with a
CUDA build's libraries mapped). Requests keep it out of BestEffort, the class a node under memory pressure
evicts first (a store evicted stalls every worker until it is re-created), and satisfy a namespace quota
that demands them; the limit bounds a leak."""
ANNOTATION_GENERATION = "resilientjob.io/generation"
ANNOTATION_LAYOUT = "resilientjob.io/layout"
ANNOTATION_STRIKES = "resilientjob.io/strikes"
"""On a replacement pod: quick failures in a row of the pods it replaces (its crash-loop backoff)."""
MANAGER = "resilientjob-operator"
PODINFO_DIR = "/etc/podinfo"
PLAN_DIR = "/etc/resilientjob"
AGENT_COMMAND = ["python", "-m", "resilientjob.agent"]
AGENT_METRICS_PORT = 9400
"""Where each worker's agent serves Prometheus metrics (RJOB_AGENT_METRICS_PORT, container port `metrics`)."""
AGENT_METRICS_ENV = "RJOB_AGENT_METRICS_PORT"
SCRATCH_DIR = "/tmp"
"""The one writable directory of a worker whose root filesystem is read-only (an emptyDir)."""
WORKER_UID = 10001
"""The image's `rjob` user (Dockerfile); any non-root uid works for images that bring their own."""

# Pod Security Standard "restricted": what a namespace labelled pod-security.kubernetes.io/enforce=restricted
# admits. The chart's `workers.podSecurityContext` / `workers.securityContext` replace these when set.
WORKER_POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": WORKER_UID,
    "runAsGroup": WORKER_UID,
    # Checkpoint volumes become writable by the worker's group.
    "fsGroup": WORKER_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
WORKER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
# With a read-only root, every cache torch and its helpers write goes under the scratch emptyDir.
SCRATCH_ENV = {
    "TMPDIR": SCRATCH_DIR,
    "XDG_CACHE_HOME": f"{SCRATCH_DIR}/cache",
    "TORCH_HOME": f"{SCRATCH_DIR}/torch",
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_DIR}/torchinductor",
    "TRITON_CACHE_DIR": f"{SCRATCH_DIR}/triton",
    "MPLCONFIGDIR": f"{SCRATCH_DIR}/matplotlib",
}


# A job's name is a DNS-1123 subdomain of up to 253 characters; the names derived from it stay valid (see
# `_names.fit`): a pod's name is also its hostname (a DNS label), a Service's name is a DNS-1035 label.
def pod_name(job: str, node: int) -> str:
    return fit(job, f"-node-{node}", dns_label=True)


def service_name(job: str) -> str:
    return fit(job, "-workers", dns1035=True)


def store_pod_name(job: str) -> str:
    return fit(job, "-store", dns_label=True)


def plan_configmap_name(job: str) -> str:
    return fit(job, "-plan", SUBDOMAIN_MAX)


def profile_configmap_name(job: str) -> str:
    return fit(job, "-profile", SUBDOMAIN_MAX)


def job_label(job: str) -> str:
    """The value of the job label of a job's objects (a label value has at most 63 characters)."""
    return fit(job)


PROFILE_KEY = "profile.json"
"""The key of the profile ConfigMap holding the `ModelProfile` JSON."""


def profile_configmap(body: Mapping[str, Any], profile_json: str, source: str) -> dict[str, Any]:
    """The durable record of a profile that node 0's agent made (owned by the job, gone with it)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(body, profile_configmap_name(body["metadata"]["name"])),
        "data": {PROFILE_KEY: profile_json, "source": source},
    }


def job_labels(job: str) -> dict[str, str]:
    return {LABEL_NAME: "resilientjob", LABEL_MANAGED_BY: MANAGER, LABEL_JOB: job_label(job)}


def job_selector(job: str) -> str:
    return f"{LABEL_JOB}={job_label(job)}"


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": meta["name"],
        "uid": meta.get("uid") or "",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    body: Mapping[str, Any], name: str, extra_labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    job = body["metadata"]["name"]
    return {
        "name": name,
        "namespace": body["metadata"]["namespace"],
        "labels": {**job_labels(job), **(extra_labels or {})},
        "ownerReferences": [owner_reference(body)],
    }


def service_manifest(body: Mapping[str, Any]) -> dict[str, Any]:
    """Headless: each worker gets a stable DNS name `<pod>.<service>` for rendezvous and layer copies."""
    job = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(body, service_name(job)),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: job_label(job)},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": 29500}, {"name": "transfer", "port": 29600}],
        },
    }


def plan_configmap(body: Mapping[str, Any], announcement: PlanAnnouncement) -> dict[str, Any]:
    job = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(body, plan_configmap_name(job)),
        "data": plan_configmap_data(announcement),
    }


def plan_configmap_data(announcement: PlanAnnouncement) -> dict[str, str]:
    return {
        "generation": str(announcement.generation),
        "layout": announcement.layout,
        "policy": announcement.policy,
        "plan.json": announcement.model_dump_json(),
    }


def generation_annotations(generation: int, layout: str) -> dict[str, str]:
    return {ANNOTATION_GENERATION: str(generation), ANNOTATION_LAYOUT: layout}


def workload(spec: api.ResilientJobSpec) -> Workload:
    """What every worker trains with (the pod's `RJOB_WORKLOAD`), from the validated spec."""
    return Workload(
        model=spec.model,
        data=spec.data or DataSpec(format=DataFormat.SYNTHETIC, seq_len=16),
        training=spec.training,
        output=spec.output,
        checkpoint=WorkloadCheckpoint(
            path=spec.checkpoint.path,
            interval_s=spec.checkpoint.interval_s,
            interval_steps=spec.checkpoint.interval_steps,
        ),
        device=spec.device_resource.device_kind,
    )


CANN_ENV_SCRIPTS = ("/usr/local/Ascend/ascend-toolkit/set_env.sh", "/usr/local/Ascend/nnal/atb/set_env.sh")
"""What the image's entry point sources on Ascend (deploy/image/entrypoint.sh) so torch_npu finds CANN."""


def _worker_command(spec: api.ResilientJobSpec) -> list[str]:
    """The worker container's command: the job's, else the agent. A pod's `command` replaces the image's
    entry point, which on Ascend loads CANN's environment; an Ascend worker's command therefore runs behind
    a shell that sources the same scripts where the image has them (vendor images that set the variables
    with ENV have none, and lose nothing)."""
    command = list(spec.command) or list(AGENT_COMMAND)
    if spec.device_resource is not api.DeviceResource.ASCEND_NPU:
        return command
    load = " ".join(CANN_ENV_SCRIPTS)
    script = f'for f in {load}; do if [ -f "$f" ]; then . "$f"; fi; done; exec "$@"'
    return ["sh", "-c", script, "sh", *command]


def pod_manifest(
    body: Mapping[str, Any],
    spec: api.ResilientJobSpec,
    node: int,
    generation: int,
    layout: str,
    redis_url: str,
) -> dict[str, Any]:
    job = body["metadata"]["name"]
    namespace = body["metadata"]["namespace"]
    env: list[dict[str, Any]] = [
        {"name": "RJOB_JOB", "value": job},
        {"name": "RJOB_JOB_UID", "value": body["metadata"].get("uid") or ""},
        {"name": "RJOB_NAMESPACE", "value": namespace},
        {"name": "RJOB_NODE", "value": str(node)},
        {"name": "RJOB_NODES", "value": str(spec.nodes)},
        {"name": "RJOB_MODEL", "value": spec.model},
        {"name": "RJOB_REDIS_URL", "value": redis_url},
        {"name": "RJOB_PODINFO_DIR", "value": PODINFO_DIR},
        {"name": WORKLOAD_ENV, "value": workload(spec).model_dump_json(by_alias=True)},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": AGENT_METRICS_ENV, "value": str(AGENT_METRICS_PORT)},
        *({"name": name, "value": value} for name, value in SCRATCH_ENV.items()),
    ]
    if spec.chaos.enabled:
        env.append({"name": "RJOB_ALLOW_CHAOS", "value": "1"})  # protocol.chaos.ALLOW_ENV
    env.extend(_password_env(spec))
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image,
        "command": _worker_command(spec),
        # A worker that dies before its agent can write its termination message (a bad image, a missing
        # module) is told by its log's tail: the job's failure quotes it after the pod is deleted.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": env,
        "ports": [{"name": "metrics", "containerPort": AGENT_METRICS_PORT, "protocol": "TCP"}],
        "securityContext": copy.deepcopy(WORKER_SECURITY_CONTEXT),
        "volumeMounts": [
            {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
            {"name": "scratch", "mountPath": SCRATCH_DIR},
        ],
    }
    if spec.device_resource is not api.DeviceResource.NONE:
        count = str(spec.gpus_per_node)
        container["resources"] = {"limits": {spec.device_resource.value: count}}
    volumes: list[dict[str, Any]] = [
        {
            "name": "podinfo",
            "downwardAPI": {
                "items": [
                    {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                ]
            },
        },
        {"name": "scratch", "emptyDir": {}},
    ]
    in_scratch = spec.checkpoint.path.rstrip("/") == SCRATCH_DIR or spec.checkpoint.path.startswith(
        f"{SCRATCH_DIR}/"
    )
    if spec.checkpoint.volume:
        volumes.append({"name": "checkpoint", "persistentVolumeClaim": {"claimName": spec.checkpoint.volume}})
    elif not in_scratch:
        # Without a claim the checkpoint fallback still needs somewhere writable (node-local: it does not
        # outlive the pod, which is what a job without a checkpoint volume accepts).
        volumes.append({"name": "checkpoint", "emptyDir": {}})
    if spec.checkpoint.volume or not in_scratch:
        container["volumeMounts"].append({"name": "checkpoint", "mountPath": spec.checkpoint.path})
    for volume in spec.volumes:
        volumes.append(
            {
                "name": f"user-{volume.name}",
                "persistentVolumeClaim": {"claimName": volume.claim_name, "readOnly": volume.read_only},
            }
        )
        container["volumeMounts"].append(
            {"name": f"user-{volume.name}", "mountPath": volume.mount_path, "readOnly": volume.read_only}
        )
    metadata = _metadata(body, pod_name(job, node), {LABEL_NODE: str(node)})
    metadata["annotations"] = generation_annotations(generation, layout)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "hostname": pod_name(job, node),
            "subdomain": service_name(job),
            # The operator replaces failed workers through the planner, never by kubelet restarts that would
            # bring stale state back into a job that has moved on.
            "restartPolicy": "Never",
            "securityContext": copy.deepcopy(WORKER_POD_SECURITY_CONTEXT),
            "containers": [container],
            "volumes": volumes,
        },
    }
    return apply_overrides(pod, spec.pod_overrides)


def _password_env(spec: api.ResilientJobSpec) -> list[dict[str, Any]]:
    secret = spec.redis.password_secret_ref
    if secret is None:
        return []
    ref = {"secretKeyRef": {"name": secret.name, "key": secret.key}}
    return [{"name": "RJOB_REDIS_PASSWORD", "valueFrom": ref}]


def store_pod_manifest(body: Mapping[str, Any], spec: api.ResilientJobSpec, redis_url: str) -> dict[str, Any]:
    """The job's store pod: one small process hosting the job's TCPStore and relaying the committed plan from
    Redis into it (`agent.store_host`). No device, no checkpoint volume, no node label. `OnFailure`: a
    kubelet restarts a crashed host in place (same pod IP); the operator re-creates a pod that is gone."""
    job = body["metadata"]["name"]
    env: list[dict[str, Any]] = [
        {"name": "RJOB_JOB", "value": job},
        {"name": "RJOB_JOB_UID", "value": body["metadata"].get("uid") or ""},
        {"name": "RJOB_NAMESPACE", "value": body["metadata"]["namespace"]},
        {"name": "RJOB_REDIS_URL", "value": redis_url},
        {"name": "RJOB_STORE_PORT", "value": str(STORE_PORT)},  # agent.store_host.STORE_PORT_ENV
        {"name": WORKLOAD_ENV, "value": workload(spec).model_dump_json(by_alias=True)},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *({"name": name, "value": value} for name, value in SCRATCH_ENV.items()),
        *_password_env(spec),
    ]
    container: dict[str, Any] = {
        "name": "store",
        "image": spec.image,
        "command": list(STORE_COMMAND),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": copy.deepcopy(STORE_RESOURCES),
        "env": env,
        "ports": [{"name": "rendezvous", "containerPort": STORE_PORT, "protocol": "TCP"}],
        "securityContext": copy.deepcopy(WORKER_SECURITY_CONTEXT),
        "volumeMounts": [{"name": "scratch", "mountPath": SCRATCH_DIR}],
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(body, store_pod_name(job), {LABEL_ROLE: ROLE_STORE}),
        "spec": {
            "hostname": store_pod_name(job),
            "subdomain": service_name(job),
            "restartPolicy": "OnFailure",
            "securityContext": copy.deepcopy(WORKER_POD_SECURITY_CONTEXT),
            "containers": [container],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        },
    }
    return apply_overrides(pod, spec.pod_overrides, worker=False)
