"""The Helm chart: `helm lint --strict` and `helm template` with every values file under ci/, every rendered
object validated strictly against a current Kubernetes version, and the properties the chart promises
(security context, peering, Redis modes, worker defaults, CRD guard, values schema)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from _chart import CHART, CI_VALUES, ROOT, find, helm, objects, one, render, validate

from resilientjob.cli import build_parser
from resilientjob.operator.crd import crd_manifest

VALUE_SETS = [pytest.param([], id="defaults")] + [pytest.param([path], id=path.stem) for path in CI_VALUES]


def test_every_ci_values_file_is_covered() -> None:
    assert {p.stem for p in CI_VALUES} >= {
        "cpu-values",
        "gpu-values",
        "ascend-values",
        "external-redis-values",
        "ha-values",
    }


@pytest.mark.parametrize("values", VALUE_SETS)
def test_lint_template_and_validate(values: list[Path]) -> None:
    args = ["lint", "--strict", str(CHART)] + [arg for path in values for arg in ("-f", str(path))]
    assert "0 chart(s) failed" in helm(*args).stdout
    docs = objects(values)
    assert docs
    for doc in docs:
        validate(doc)
    # Pod Security "restricted": every container of every workload.
    for workload in find(docs, "Deployment"):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, container["name"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["capabilities"]["drop"] == ["ALL"], container["name"]
            assert container["resources"]["limits"]["memory"], container["name"]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = one(docs, "Deployment", "resilientjob")
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("values", VALUE_SETS)
def test_operator_arguments_are_accepted_by_rjob_operator(values: list[Path]) -> None:
    args = operator_container(objects(values))["args"]
    assert args[0] == "operator"
    parsed = build_parser("operator").parse_args(args)
    assert parsed.metrics_port == 9090 and parsed.health_port == 8080


def test_the_operators_tuning_values_reach_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilientjob.operator.settings import OperatorSettings

    sets = {"operator.joinSettleSeconds": "3", "operator.replaceBackoffMaxSeconds": "60"}
    sets |= {"operator.env[0].name": "RJOB_PEERING_PRIORITY", "operator.env[0].value": "seven"}
    env = {name: item.get("value") for name, item in env_of(operator_container(objects(sets=sets))).items()}
    assert env["RJOB_PEERING_PRIORITY"] == "seven"
    for name, value in env.items():
        if name.startswith("RJOB_") and name != "RJOB_PEERING_PRIORITY" and isinstance(value, str):
            monkeypatch.setenv(name, value)
    settings = OperatorSettings.from_env()
    assert (settings.join_settle_s, settings.replace_backoff_s, settings.replace_backoff_max_s) == (
        3.0,
        10.0,
        60.0,
    )


def test_defaults_watch_the_release_namespace_with_peering() -> None:
    docs = objects()
    args = operator_container(docs)["args"]
    assert "--namespace=rj-system" in args and "--standalone" not in args
    role = one(docs, "Role")
    assert role["metadata"]["namespace"] == "rj-system"
    peering = one(docs, "KopfPeering")
    assert peering["metadata"]["namespace"] == "rj-system"
    assert not find(docs, "ClusterKopfPeering")
    assert one(docs, "Deployment", "resilientjob")["spec"]["replicas"] == 1


def test_peering_name_is_the_operators() -> None:
    import kopf

    from resilientjob.operator import handlers

    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings)
    assert one(objects(), "KopfPeering")["metadata"]["name"] == settings.peering.name
    assert one(objects([CHART / "ci" / "ha-values.yaml"]), "ClusterKopfPeering")["metadata"]["name"] == (
        settings.peering.name
    )


def test_listed_namespaces_get_a_role_and_a_peering_each() -> None:
    docs = objects([CHART / "ci" / "gpu-values.yaml"])
    assert "--namespace=team-a,team-b" in operator_container(docs)["args"]
    assert sorted(r["metadata"]["namespace"] for r in find(docs, "Role")) == ["team-a", "team-b"]
    assert sorted(r["metadata"]["namespace"] for r in find(docs, "RoleBinding")) == ["team-a", "team-b"]
    assert sorted(p["metadata"]["namespace"] for p in find(docs, "KopfPeering")) == ["team-a", "team-b"]
    for binding in find(docs, "RoleBinding"):
        assert binding["subjects"][0]["namespace"] == "rj-system"


def test_ha_runs_two_peered_replicas_cluster_wide() -> None:
    docs = objects([CHART / "ci" / "ha-values.yaml"])
    deployment = one(docs, "Deployment", "resilientjob")
    assert deployment["spec"]["replicas"] == 2
    args = operator_container(docs)["args"]
    assert not any(a.startswith("--namespace") for a in args) and "--standalone" not in args
    affinity = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"][
        "topologyKey"
    ] == ("kubernetes.io/hostname")
    assert not find(docs, "Role") and one(docs, "ClusterRole", "-jobs")


def test_two_replicas_without_peering_is_refused() -> None:
    done = render(sets={"operator.replicas": "2", "operator.peering": "false"}, check=False)
    assert not isinstance(done, list) and done.returncode != 0
    assert "needs operator.peering" in done.stderr


def test_a_backoff_above_its_maximum_is_refused() -> None:
    done = render(sets={"operator.replaceBackoffSeconds": "400"}, check=False)
    assert not isinstance(done, list) and done.returncode != 0
    assert "must not exceed operator.replaceBackoffMaxSeconds" in done.stderr


def test_standalone_without_peering_recreates() -> None:
    docs = objects(sets={"operator.peering": "false"})
    assert "--standalone" in operator_container(docs)["args"]
    assert one(docs, "Deployment", "resilientjob")["spec"]["strategy"]["type"] == "Recreate"
    assert not find(docs, "KopfPeering") and not any(
        "kopfpeerings" in rule["resources"] for rule in one(docs, "Role")["rules"]
    )


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"operator.replicas": "3"}, "replicas"),
        ({"workers.accelerator": "amd"}, "accelerator"),
        ({"redis.mode": "sentinel"}, "mode"),
        ({"operator.metricsPort": "80"}, "metricsPort"),
        ({"operator.unknownKey": "1"}, "unknownKey"),
    ],
)
def test_values_schema_rejects_bad_values(sets: dict[str, str], message: str) -> None:
    done = render(sets=sets, check=False)
    assert not isinstance(done, list) and done.returncode != 0
    assert message in done.stderr


def test_builtin_redis_has_a_generated_password_that_never_appears_in_plain_text() -> None:
    docs = objects()
    secret = one(docs, "Secret", "-redis")
    import base64

    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) == 40 and password.isalnum()
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    again = render(check=False)
    assert not isinstance(again, list)
    assert (
        one([d for d in yaml.safe_load_all(again.stdout) if d], "Secret", "-redis")["data"]["password"]
        != (secret["data"]["password"])
    ), "the password is not generated per install"
    env = env_of(operator_container(docs))
    assert env["RJOB_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "rj-resilientjob-redis",
        "key": "password",
    }
    assert (
        env["RJOB_REDIS_URL"]["value"]
        == "redis://:$(RJOB_REDIS_PASSWORD)@rj-resilientjob-redis.rj-system.svc:6379/0"
    )
    redis = one(docs, "Deployment", "-redis")
    text = yaml.safe_dump([d for d in docs if d["kind"] != "Secret"])
    assert password not in text
    assert "$REDIS_PASSWORD" in redis["spec"]["template"]["spec"]["containers"][0]["args"][0]
    policy = one(docs, "NetworkPolicy")
    sources = policy["spec"]["ingress"][0]["from"]
    assert {"app.kubernetes.io/managed-by": "resilientjob-operator"} in [
        s["podSelector"]["matchLabels"] for s in sources
    ]


def test_existing_secret_replaces_the_generated_one() -> None:
    docs = objects(sets={"redis.builtin.existingSecret": "mine"})
    assert not find(docs, "Secret")
    assert (
        env_of(operator_container(docs))["RJOB_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "mine"
    )


def _redis_volume(docs: list[dict[str, Any]]) -> dict[str, Any]:
    volumes = one(docs, "Deployment", "-redis")["spec"]["template"]["spec"]["volumes"]
    return next(v for v in volumes if v["name"] == "data")


def test_builtin_redis_keeps_its_keys_on_a_claim_unless_turned_off() -> None:
    docs = objects(
        sets={"redis.builtin.persistence.storageClass": "fast", "redis.builtin.persistence.size": "5Gi"}
    )
    claim = one(docs, "PersistentVolumeClaim", "-redis")
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert _redis_volume(docs)["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "--appendonly yes --appendfsync everysec" in redis_command(docs)
    off = objects(sets={"redis.builtin.persistence.enabled": "false"})
    assert not find(off, "PersistentVolumeClaim")
    assert _redis_volume(off) == {"name": "data", "emptyDir": {}}
    assert "--appendonly no" in redis_command(off)
    refused = render(sets={"redis.builtin.persistence.appendfsync": "sometimes"}, check=False)
    assert not isinstance(refused, list) and "appendfsync" in refused.stderr


def redis_command(docs: list[dict[str, Any]]) -> str:
    args: list[str] = one(docs, "Deployment", "-redis")["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[0]


@pytest.mark.parametrize("persistence", [True, False], ids=["persistent", "ephemeral"])
def test_the_charts_redis_command_survives_a_sigkill_only_with_persistence(
    tmp_path: Path, persistence: bool
) -> None:
    """Run the chart's own Redis command line (its paths moved to a temp dir, on a unix socket) against the
    real redis-server: a key written a second before a SIGKILL is there after the restart only with the
    append-only file on."""
    import os
    import shutil
    import signal
    import subprocess
    import time

    import redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    command = redis_command(objects(sets={"redis.builtin.persistence.enabled": str(persistence).lower()}))
    data = tmp_path / "data"
    data.mkdir()
    socket = tmp_path / "redis.sock"
    command = command.replace("/tmp/redis.conf", str(tmp_path / "redis.conf")).replace(
        "--dir /data", f"--dir {data}"
    )
    command += f" --port 0 --unixsocket {socket}"
    env = {**os.environ, "REDIS_PASSWORD": "secret"}

    def start() -> subprocess.Popen[bytes]:
        server = subprocess.Popen(["sh", "-c", command], env=env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not socket.exists():
            assert server.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        return server

    server = start()
    try:
        client = redis.Redis(unix_socket_path=str(socket), password="secret")
        client.set("rjob:plan", "generation 7")
        time.sleep(1.5)  # one appendfsync=everysec interval and a margin
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        socket.unlink(missing_ok=True)
        server = start()
        client = redis.Redis(unix_socket_path=str(socket), password="secret")
        assert client.get("rjob:plan") == (b"generation 7" if persistence else None)
    finally:
        server.kill()
        server.wait(10)


def test_external_redis_renders_no_redis() -> None:
    docs = objects([CHART / "ci" / "external-redis-values.yaml"])
    assert (
        not find(docs, "Deployment", "-redis")
        and not find(docs, "Secret")
        and not find(docs, "NetworkPolicy")
    )
    env = env_of(operator_container(docs))
    assert env["RJOB_REDIS_URL"]["value"] == "rediss://:$(RJOB_REDIS_PASSWORD)@redis.data.svc:6380/3"
    assert env["RJOB_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "training-redis",
        "key": "redis-password",
    }
    # Without a password Secret, the URL is used as given and no password variable is set.
    plain = objects(sets={"redis.mode": "external", "redis.external.url": "redis://r:6379/0"})
    env = env_of(operator_container(plain))
    assert env["RJOB_REDIS_URL"]["value"] == "redis://r:6379/0" and "RJOB_REDIS_PASSWORD" not in env
    missing = render(sets={"redis.mode": "external"}, check=False)
    assert not isinstance(missing, list) and "redis.external.url is required" in missing.stderr


def worker_defaults(docs: list[dict[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        one(docs, "ConfigMap", "-worker-defaults")["data"]["worker-defaults.json"]
    )
    return data


def test_worker_defaults_per_accelerator() -> None:
    cpu = worker_defaults(objects())
    assert cpu["resourceName"] == "" and cpu["nodeSelector"] == {} and cpu["tolerations"] == []
    gpu = worker_defaults(objects([CHART / "ci" / "gpu-values.yaml"]))
    assert gpu["resourceName"] == "nvidia.com/gpu"
    assert gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert gpu["tolerations"][0]["key"] == "nvidia.com/gpu" and gpu["shmSize"] == "32Gi"
    ascend = worker_defaults(objects([CHART / "ci" / "ascend-values.yaml"]))
    assert ascend["resourceName"] == "huawei.com/Ascend910"
    # The preset's selector and tolerations are kept and the user's are added.
    assert ascend["nodeSelector"] == {"accelerator": "huawei-Ascend910", "node-pool": "npu"}
    assert [t["key"] for t in ascend["tolerations"]] == ["huawei.com/Ascend910", "dedicated"]
    assert ascend["env"] == [{"name": "HCCL_CONNECT_TIMEOUT", "value": "600"}]
    # The operator is restarted when they change (they are read at start).
    deployments = [
        one(objects(v), "Deployment", "resilientjob") for v in ([], [CHART / "ci" / "gpu-values.yaml"])
    ]
    checksums = {
        d["spec"]["template"]["metadata"]["annotations"]["checksum/worker-defaults"] for d in deployments
    }
    assert len(checksums) == 2
    env = env_of(operator_container(objects()))
    mounts = {m["name"]: m["mountPath"] for m in operator_container(objects())["volumeMounts"]}
    assert env["RJOB_WORKER_DEFAULTS"]["value"] == f"{mounts['worker-defaults']}/worker-defaults.json"


def test_crd_is_the_generated_one_and_guarded() -> None:
    rendered = one(objects(), "CustomResourceDefinition")
    generated = crd_manifest()
    assert rendered["spec"] == generated["spec"]
    assert rendered["metadata"]["name"] == generated["metadata"]["name"]
    assert rendered["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert (
        "annotations" not in one(objects(sets={"crds.keep": "false"}), "CustomResourceDefinition")["metadata"]
    )
    assert not find(objects(sets={"crds.install": "false"}), "CustomResourceDefinition")


def test_kopf_peering_crds_are_in_the_charts_crds_folder() -> None:
    names = {
        doc["metadata"]["name"]
        for doc in yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml").read_text())
    }
    assert names == {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}


def test_metrics_service_monitor_and_dashboard() -> None:
    docs = objects([CHART / "ci" / "gpu-values.yaml"])
    service = one(docs, "Service", "-metrics")
    deployment = one(docs, "Deployment", "resilientjob")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    # The operator's job label is `rjob`, so nothing collides with the target's `job` label any more.
    assert "honorLabels" not in monitor["spec"]["endpoints"][0]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    dashboard = one(docs, "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    assert json.loads(dashboard["data"]["resilientjob.json"]) == shipped
    rule = one(docs, "PrometheusRule")
    assert {r["alert"] for r in rule["spec"]["groups"][0]["rules"]} >= {
        "ResilientJobDegraded",
        "ResilientJobRepeatedRecoveries",
        "ResilientJobFailSlowPersisting",
    }
    assert not find(objects(), "ServiceMonitor") and not find(objects(), "PrometheusRule")
    assert not find(objects(), "PodMonitor")


def test_service_monitor_needs_the_service() -> None:
    done = render(
        sets={"metrics.serviceMonitor.enabled": "true", "metrics.service.enabled": "false"}, check=False
    )
    assert not isinstance(done, list) and "needs metrics.service.enabled" in done.stderr


def test_chart_version_matches_the_package() -> None:
    import tomllib

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


def test_install_notes_point_at_real_files() -> None:
    notes = helm("install", "rj", str(CHART), "--namespace", "rj-system", "--dry-run=client").stdout
    notes = notes.split("NOTES:", 1)[1]
    assert "It runs ResilientJobs in: rj-system" in notes
    for path in re.findall(r"examples/[\w.-]+\.yaml", notes):
        assert (ROOT / path).exists(), path
