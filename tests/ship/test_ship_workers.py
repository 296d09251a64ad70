"""Worker pods as the chart's operator creates them: Pod Security "restricted" by default (checked field by
field against the profile's rules, and the pod validated with kubernetes-validate), overridable through the
chart's `workers` values; per-worker metrics a PodMonitor scrapes; the default Redis's password reaching
workers by a secretKeyRef, never in the pod spec; and the operator's probes on kopf's health endpoint."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from _chart import CHART, find, objects, one, validate

from resilientjob.operator import api
from resilientjob.operator._manifests import AGENT_METRICS_ENV, LABEL_JOB, LABEL_NODE, pod_manifest
from resilientjob.operator._worker_defaults import WorkerDefaults
from resilientjob.operator.settings import OperatorSettings
from resilientjob.protocol.workload import WORKLOAD_ENV, load_workload

VALUES = [None, CHART / "ci" / "gpu-values.yaml", CHART / "ci" / "ascend-values.yaml"]
# Pod Security Standards, "restricted" (https://kubernetes.io/docs/concepts/security/pod-security-standards/).
RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SECRET = "s3cretpassw0rd"


def defaults(values: Path | None = None, sets: dict[str, str] | None = None) -> WorkerDefaults:
    docs = objects([values] if values else [], sets)
    data = json.loads(one(docs, "ConfigMap", "-worker-defaults")["data"]["worker-defaults.json"])
    return WorkerDefaults.model_validate(data)


def job_pod(redis_url: str = "redis://r:6379/0", **spec: Any) -> dict[str, Any]:
    parsed = api.parse_spec(
        {
            "image": "example/worker:1",
            "model": "llama2-7b",
            "nodes": 4,
            "gpusPerNode": 8,
            "deviceResource": "nvidia.com/gpu",
            "globalBatchSize": 64,
            "microBatchSize": 1,
            **spec,
        }
    )
    body = {"metadata": {"name": "llama", "namespace": "rj-system", "uid": "u-1"}}
    return pod_manifest(body, parsed, node=2, generation=0, layout="DP1 PP[4]", redis_url=redis_url)


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every rule of the "restricted" profile (baseline included) that can be checked on a manifest."""
    spec = pod["spec"]
    context = spec.get("securityContext") or {}
    found = [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            found.append(f"volume {volume['name']} of type {sorted(kinds)}")
    if context.get("seccompProfile", {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        found.append("pod seccompProfile")
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        own = container.get("securityContext") or {}
        name = container["name"]
        if own.get("privileged"):
            found.append(f"{name}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if not own.get("runAsNonRoot", context.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot is not true")
        if own.get("runAsUser", context.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = own.get("seccompProfile", context.get("seccompProfile")) or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp.get('type')}")
        capabilities = own.get("capabilities") or {}
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds {capabilities['add']}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.stem if v else "defaults")
@pytest.mark.parametrize("checkpoint", [{}, {"volume": "ckpt", "path": "/ckpt"}], ids=["no-pvc", "pvc"])
def test_worker_pods_are_pod_security_restricted(values: Path | None, checkpoint: dict[str, str]) -> None:
    pod = defaults(values).apply(job_pod(checkpoint=checkpoint))
    validate(pod)
    assert restricted_violations(pod) == []
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # A read-only root: every path the worker writes is a volume mount.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    env["checkpoint"] = load_workload(env[WORKLOAD_ENV]).checkpoint.path
    for variable in ("TMPDIR", "XDG_CACHE_HOME", "TORCH_HOME", "TRITON_CACHE_DIR", "checkpoint"):
        path = env[variable]
        assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (variable, path)
    checkpoint_volume = volumes[mounts[env["checkpoint"]]]
    if checkpoint:
        assert checkpoint_volume["persistentVolumeClaim"]["claimName"] == "ckpt"
    else:
        assert "emptyDir" in checkpoint_volume


def test_the_rule_check_catches_what_restricted_refuses() -> None:
    pod = job_pod()
    pod["spec"]["hostNetwork"] = True
    pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    context = pod["spec"]["containers"][0]["securityContext"]
    context.update(allowPrivilegeEscalation=True, capabilities={"drop": [], "add": ["SYS_ADMIN"]})
    pod["spec"]["securityContext"] = {"runAsUser": 0}
    context.pop("runAsNonRoot")
    context.pop("seccompProfile")
    found = " ".join(restricted_violations(pod))
    for rule in ("hostNetwork", "hostPath", "allowPrivilegeEscalation", "runAsNonRoot", "runAsUser 0"):
        assert rule in found, rule
    assert "seccompProfile" in found and "capabilities not dropped" in found and "SYS_ADMIN" in found


def test_security_contexts_are_overridable_through_the_chart() -> None:
    relaxed = defaults(
        sets={
            "workers.securityContext.readOnlyRootFilesystem": "false",
            "workers.podSecurityContext.runAsUser": "2000",
        }
    )
    pod = relaxed.apply(job_pod())
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False
    assert pod["spec"]["securityContext"]["runAsUser"] == 2000
    # Values files merge into the defaults: Ascend adds the driver's group and stays restricted.
    ascend = defaults(CHART / "ci" / "ascend-values.yaml").apply(job_pod())
    assert ascend["spec"]["securityContext"]["supplementalGroups"] == [1000]
    assert restricted_violations(ascend) == []
    # Without values the operator's own restricted contexts stay (an operator run without the chart).
    bare = WorkerDefaults().apply(job_pod())
    assert restricted_violations(bare) == []


def test_worker_metrics_are_exposed_and_scraped() -> None:
    docs = objects([CHART / "ci" / "gpu-values.yaml"])
    pod = defaults(CHART / "ci" / "gpu-values.yaml").apply(job_pod())
    container = pod["spec"]["containers"][0]
    port = next(p for p in container["ports"] if p["name"] == "metrics")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[AGENT_METRICS_ENV] == str(port["containerPort"])
    monitor = one(docs, "PodMonitor")
    validate(monitor)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["team-a", "team-b"]
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # Prometheus exposes a pod label as __meta_kubernetes_pod_label_<name with non-alphanumerics as _>.
    relabel = {r["targetLabel"]: r["sourceLabels"][0] for r in endpoint["relabelings"]}
    meta = {
        "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in key): value
        for key, value in pod["metadata"]["labels"].items()
    }
    assert meta[relabel["rjob"]] == pod["metadata"]["labels"][LABEL_JOB] == "llama"
    assert meta[relabel["node"]] == pod["metadata"]["labels"][LABEL_NODE] == "2"
    assert one(
        objects([CHART / "ci" / "ha-values.yaml"], {"metrics.podMonitor.enabled": "true"}), "PodMonitor"
    )["spec"]["namespaceSelector"] == {"any": True}


def operator_redis_url(docs: list[dict[str, Any]], password: str) -> str:
    """The operator's RJOB_REDIS_URL as its process sees it, after Kubernetes splices the Secret in."""
    container = one(docs, "Deployment", "resilientjob")["spec"]["template"]["spec"]["containers"][0]
    url: str = next(e["value"] for e in container["env"] if e["name"] == "RJOB_REDIS_URL")
    return url.replace("$(RJOB_REDIS_PASSWORD)", password)


@pytest.mark.parametrize(
    "values", [None, CHART / "ci" / "external-redis-values.yaml"], ids=["builtin", "external"]
)
def test_default_redis_password_reaches_workers_through_the_secret(values: Path | None) -> None:
    docs = objects([values] if values else [])
    worker_defaults = defaults(values)
    pod = worker_defaults.apply(job_pod(redis_url=operator_redis_url(docs, SECRET)))
    assert SECRET not in yaml.safe_dump(pod)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["RJOB_REDIS_URL"]["value"] == operator_redis_url(docs, "").replace(":@", "")
    ref = env["RJOB_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    operator_env = one(docs, "Deployment", "resilientjob")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert (
        ref
        == next(e for e in operator_env if e["name"] == "RJOB_REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    )
    validate(pod)


def test_jobs_with_their_own_redis_are_left_alone() -> None:
    docs = objects()
    worker_defaults = defaults()
    own = {"url": "redis://team-redis:6379/0", "passwordSecretRef": {"name": "team", "key": "pw"}}
    pod = worker_defaults.apply(job_pod(redis_url="redis://team-redis:6379/0", redis=own))
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["RJOB_REDIS_URL"]["value"] == "redis://team-redis:6379/0"
    assert env["RJOB_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "team", "key": "pw"}
    # A job on an AUTH-less Redis of its own must not be sent the default Redis's password.
    plain = worker_defaults.apply(
        job_pod(redis_url="redis://other:6379/0", redis={"url": "redis://other:6379/0"})
    )
    assert "RJOB_REDIS_PASSWORD" not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}
    assert operator_redis_url(docs, SECRET).count(SECRET) == 1


def test_each_watched_namespace_gets_the_generated_password() -> None:
    docs = objects([CHART / "ci" / "gpu-values.yaml"])
    secrets = find(docs, "Secret", "-redis")
    assert sorted(s["metadata"]["namespace"] for s in secrets) == ["rj-system", "team-a", "team-b"]
    assert len({s["data"]["password"] for s in secrets}) == 1
    assert len(base64.b64decode(secrets[0]["data"]["password"])) == 40
    cluster_wide = objects([CHART / "ci" / "ha-values.yaml"])
    assert [s["metadata"]["namespace"] for s in find(cluster_wide, "Secret", "-redis")] == ["rj-system"]


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.stem if v else "defaults")
def test_operator_probes_ask_kopfs_health_endpoint(values: Path | None) -> None:
    container = one(objects([values] if values else []), "Deployment", "resilientjob")["spec"]["template"][
        "spec"
    ]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--health-port={ports['health']}" in container["args"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe


def test_health_port_settings() -> None:
    assert OperatorSettings().liveness_endpoint is None
    assert OperatorSettings(health_port=8080).liveness_endpoint == "http://0.0.0.0:8080/healthz"
    with pytest.raises(ValueError, match="health_port and metrics_port must differ"):
        OperatorSettings(health_port=9090, metrics_port=9090)
    with pytest.raises(ValueError, match="health_port"):
        OperatorSettings(health_port=70000)


def test_a_metrics_port_in_use_is_one_line_naming_the_setting_and_retried_soon() -> None:
    import socket

    import kopf

    from resilientjob.operator import handlers

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        memo = kopf.Memo(rjob=OperatorSettings(metrics_port=port))
        with pytest.raises(kopf.TemporaryError, match=f"^RJOB_METRICS_PORT={port}: cannot serve") as caught:
            handlers.configure(settings=kopf.OperatorSettings(), memo=memo)
    assert caught.value.delay == 5 and caught.value.__cause__ is None


@pytest.mark.parametrize(
    "name",
    ["poll_interval_s", "status_interval_s", "replace_backoff_s", "replace_backoff_max_s", "join_settle_s",
     "leftover_grace_s", "pods_refused_retry_s"],
)  # fmt: skip
def test_operator_settings_refuse_seconds_that_are_not_a_number(name: str) -> None:
    """`RJOB_LEFTOVER_GRACE_S=nan` passed the `< 0` check, and no stuck pod was ever stuck long enough."""
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
        OperatorSettings(**{name: float("nan")})  # type: ignore[arg-type]
