"""The local API server answers as kube-apiserver does where that changes an outcome: names, unknown
resources, the CRD's schema (defaults, pruning, types, CEL rules), resourceVersion conflicts, deletion with
finalizers and propagation policies, garbage collection by owner, watches from a version and 410 Gone,
selectors, Tables and the discovery and OpenAPI documents kubectl reads. Plain HTTP, no operator."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from _rjob_stack import api_server, emulator_only, job_manifest, rjob_path

from resilientjob.localstack.emulator import LocalApiServer

pytestmark = emulator_only("these test the local API server itself")
PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture
async def server() -> AsyncIterator[tuple[LocalApiServer, aiohttp.ClientSession, str]]:
    async with api_server() as (emulator, url), aiohttp.ClientSession(url) as client:
        yield emulator, client, url


async def call(
    client: aiohttp.ClientSession, method: str, path: str, body: Any = None, **kwargs: Any
) -> tuple[int, Any]:
    async with client.request(method, path, json=body, **kwargs) as response:
        text = await response.text()
        return response.status, json.loads(text) if text.startswith(("{", "[")) else text


def pod(name: str, owner: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    refs = (
        [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
            }
        ]
        if owner
        else []
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "ownerReferences": refs, **meta},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }


async def test_names_versions_and_schema_are_checked_as_the_api_server_does(server: Any) -> None:
    _, client, _ = server
    status, body = await call(client, "POST", rjob_path(), job_manifest("Bad_Name!"))
    assert status == 422 and 'metadata.name: Invalid value: "Bad_Name!"' in body["message"]
    status, body = await call(
        client, "POST", "/apis/resilientjob.io/v9/namespaces/default/resilientjobs", job_manifest("v9")
    )
    assert status == 404 and body["message"] == "the server could not find the requested resource"
    status, body = await call(client, "POST", rjob_path(), job_manifest("cel", faultTolerance=4))
    assert status == 422
    assert body["message"] == (
        'ResilientJob.resilientjob.io "cel" is invalid: spec.faultTolerance: Invalid '
        'value: "object": faultTolerance must be < nodes'
    )
    status, body = await call(
        client, "POST", rjob_path(), job_manifest("enum", policy="teleport", nodes=None)
    )
    assert status == 422 and "spec.nodes: Required value" in body["message"]
    assert 'spec.policy: Unsupported value: "teleport"' in body["message"]
    status, body = await call(
        client, "POST", rjob_path(), job_manifest("typo", nodez=3), params={"fieldValidation": "Strict"}
    )
    assert status == 400 and 'unknown field "spec.nodez"' in body["message"]
    # Without Strict an unknown field is pruned with a warning, and the schema's defaults are applied.
    manifest = job_manifest("ok", nodez=3, faultTolerance=None)
    async with client.post(rjob_path(), json=manifest) as response:
        assert response.status == 201 and 'unknown field \\"spec.nodez\\"' in response.headers["Warning"]
        stored = await response.json()
    assert "nodez" not in stored["spec"] and stored["spec"]["faultTolerance"] == 1
    assert stored["spec"]["policy"] == "auto" and stored["metadata"]["resourceVersion"].isdigit()
    # Transition rules run on updates: an immutable field cannot change.
    status, body = await call(
        client,
        "PATCH",
        rjob_path("ok"),
        {"spec": {"model": "synthetic:uniform-4"}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert status == 422 and 'spec.model: Invalid value: "string": model is immutable' in body["message"]


async def test_a_quantity_is_an_integer_or_a_string_of_its_pattern(server: Any) -> None:
    _, client, _ = server
    status, body = await call(client, "POST", rjob_path(), job_manifest("list", deviceMemory=[80]))
    assert status == 422
    assert (
        'spec.deviceMemory: Invalid value: "array": spec.deviceMemory in body must be of type '
        in (body["message"])
    )
    status, body = await call(client, "POST", rjob_path(), job_manifest("spaced", deviceMemory="80 GB"))
    assert status == 422 and 'spec.deviceMemory: Invalid value: "80 GB"' in body["message"]
    for name, memory in (("bytes", 85899345920), ("quantity", "80Gi")):
        status, body = await call(client, "POST", rjob_path(), job_manifest(name, deviceMemory=memory))
        assert status == 201 and body["spec"]["deviceMemory"] == memory
    status, body = await call(
        client,
        "PATCH",
        rjob_path("quantity"),
        {"spec": {"deviceMemory": "40Gi"}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert status == 422 and "deviceMemory is immutable" in body["message"]


async def test_a_stale_resource_version_is_a_conflict(server: Any) -> None:
    _, client, _ = server
    _, created = await call(client, "POST", PODS, pod("p"))
    version = created["metadata"]["resourceVersion"]
    merge = {"Content-Type": "application/merge-patch+json"}
    status, patched = await call(
        client,
        "PATCH",
        f"{PODS}/p",
        {"metadata": {"labels": {"a": "1"}, "resourceVersion": version}},
        headers=merge,
    )
    assert status == 200 and int(patched["metadata"]["resourceVersion"]) > int(version)
    status, body = await call(
        client,
        "PATCH",
        f"{PODS}/p",
        {"metadata": {"labels": {"a": "2"}, "resourceVersion": version}},
        headers=merge,
    )
    assert status == 409 and body["reason"] == "Conflict" and "has been modified" in body["message"]
    status, body = await call(client, "POST", PODS, pod("p"))
    assert status == 409 and body["reason"] == "AlreadyExists"


async def test_deletion_collects_dependents_by_policy(server: Any) -> None:
    _, client, _ = server
    for policy, kept in (("Background", False), ("Foreground", False), ("Orphan", True)):
        name = f"owner-{policy.lower()}"
        _, owner = await call(client, "POST", rjob_path(), job_manifest(name))
        for n in range(2):
            assert (await call(client, "POST", PODS, pod(f"{name}-{n}", owner)))[0] == 201
        status, _ = await call(
            client,
            "DELETE",
            rjob_path(name),
            {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": policy},
        )
        assert status == 200
        assert (await call(client, "GET", rjob_path(name)))[0] == 404
        _, pods = await call(client, "GET", PODS)
        left = {p["metadata"]["name"]: p for p in pods["items"] if p["metadata"]["name"].startswith(name)}
        assert bool(left) == kept, policy
        if kept:
            assert all(not p["metadata"]["ownerReferences"] for p in left.values())
    # An object created for an owner that is gone is collected at once (the collector's dangling owner).
    status, _ = await call(client, "POST", PODS, pod("late", owner))
    assert status == 201 and (await call(client, "GET", f"{PODS}/late"))[0] == 404


async def test_finalizers_hold_an_object_and_foreground_waits_for_dependents(server: Any) -> None:
    _, client, _ = server
    _, owner = await call(client, "POST", rjob_path(), job_manifest("held"))
    await call(client, "POST", PODS, pod("held-0", owner, finalizers=["test/hold"]))
    status, body = await call(client, "DELETE", rjob_path("held"), {"propagationPolicy": "Foreground"})
    assert status == 200 and body["metadata"]["deletionTimestamp"]
    # The dependent is held by its finalizer, so the owner waits with foregroundDeletion.
    _, job = await call(client, "GET", rjob_path("held"))
    assert job["metadata"]["finalizers"] == ["foregroundDeletion"]
    _, held = await call(client, "GET", f"{PODS}/held-0")
    assert held["metadata"]["deletionTimestamp"]
    merge = {"Content-Type": "application/merge-patch+json"}
    await call(client, "PATCH", f"{PODS}/held-0", {"metadata": {"finalizers": None}}, headers=merge)
    assert (await call(client, "GET", f"{PODS}/held-0"))[0] == 404
    assert (await call(client, "GET", rjob_path("held")))[0] == 404


async def test_a_pod_bound_to_a_node_stays_terminating_until_its_kubelet_or_a_force_confirms(
    server: Any,
) -> None:
    """kube-apiserver keeps a bound pod through its grace period until its node's kubelet deletes it with
    grace 0; on a lost node nothing does, and `kubectl delete --force` (grace 0) takes it out."""
    _, client, _ = server
    bound = pod("bound-0")
    bound["spec"] = {**bound.get("spec", {}), "nodeName": "node-a", "terminationGracePeriodSeconds": 45}
    await call(client, "POST", PODS, bound)
    status, body = await call(client, "DELETE", f"{PODS}/bound-0")
    assert status == 200 and body["metadata"]["deletionGracePeriodSeconds"] == 45
    ends = datetime.datetime.fromisoformat(body["metadata"]["deletionTimestamp"].replace("Z", "+00:00"))
    assert 40 <= (ends - datetime.datetime.now(tz=datetime.UTC)).total_seconds() <= 46
    assert (await call(client, "GET", f"{PODS}/bound-0"))[0] == 200  # Terminating
    await call(client, "DELETE", f"{PODS}/bound-0")  # deleting again changes nothing
    assert (await call(client, "GET", f"{PODS}/bound-0"))[0] == 200
    status, _ = await call(client, "DELETE", f"{PODS}/bound-0", {"gracePeriodSeconds": 0})
    assert status == 200 and (await call(client, "GET", f"{PODS}/bound-0"))[0] == 404
    # An unbound pod (no node ran it) goes at once, as does one deleted with grace 0 from the start.
    await call(client, "POST", PODS, pod("unbound-0"))
    await call(client, "DELETE", f"{PODS}/unbound-0")
    assert (await call(client, "GET", f"{PODS}/unbound-0"))[0] == 404


async def test_watch_from_a_version_then_410_after_expiry(server: Any) -> None:
    emulator, client, _ = server
    _, listing = await call(client, "GET", PODS)
    since = listing["metadata"]["resourceVersion"]
    await call(client, "POST", PODS, pod("w-0", labels={"app": "x"}))
    await call(client, "POST", PODS, pod("w-1", labels={"app": "y"}))
    params = {"watch": "true", "resourceVersion": since, "labelSelector": "app=x", "timeoutSeconds": "5"}
    async with client.get(PODS, params=params) as response:
        first = json.loads(await response.content.readline())
        assert first["type"] == "ADDED" and first["object"]["metadata"]["name"] == "w-0"
        await emulator.expire_watches()
        expired = json.loads(await response.content.readline())
    assert expired["type"] == "ERROR" and expired["object"]["code"] == 410
    params = {"watch": "true", "resourceVersion": since, "timeoutSeconds": "5"}
    async with client.get(PODS, params=params) as response:
        assert json.loads(await response.content.readline())["object"]["code"] == 410


async def test_kubectl_documents_tables_and_logs(server: Any, tmp_path: Any) -> None:
    emulator, client, _ = server
    _, discovery = await call(client, "GET", "/apis/resilientjob.io/v1alpha1")
    by_name = {r["name"]: r for r in discovery["resources"]}
    assert (
        by_name["resilientjobs"]["shortNames"] == ["rjob"]
        and "shortNames" not in by_name["resilientjobs/status"]
    )
    _, root = await call(client, "GET", "/openapi/v3")
    _, document = await call(
        client, "GET", root["paths"]["apis/resilientjob.io/v1alpha1"]["serverRelativeURL"]
    )
    patch = document["paths"]["/apis/resilientjob.io/v1alpha1/namespaces/{namespace}/resilientjobs/{name}"]
    assert "fieldValidation" in [p["name"] for p in patch["patch"]["parameters"]]
    assert (await call(client, "GET", "/openapi/v2"))[1]["swagger"] == "2.0"
    await call(client, "POST", rjob_path(), job_manifest("tab"))
    table_accept = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}
    _, table = await call(client, "GET", rjob_path(), headers=table_accept)
    assert [c["name"] for c in table["columnDefinitions"]][:4] == ["Name", "Phase", "Workers", "Reason"]
    assert table["rows"][0]["cells"][:4] == ["tab", None, None, None]
    # The Reason column's path filters the conditions by type, as kube-apiserver's JSONPath does.
    conditions = [
        {"type": "Planned", "status": "True", "reason": "Planned"},
        {"type": "WorkersReady", "status": "False", "reason": "PodNotStarting"},
    ]
    await call(client, "PATCH", rjob_path("tab", status=True), {"status": {"conditions": conditions}})
    _, table = await call(client, "GET", rjob_path(), headers=table_accept)
    assert table["rows"][0]["cells"][3] == "PodNotStarting"
    _, listing = await call(client, "GET", rjob_path())
    assert listing["kind"] == "ResilientJobList" and listing["items"][0]["kind"] == "ResilientJob"
    emulator.pod_logs = tmp_path
    (tmp_path / "lp").mkdir()
    (tmp_path / "lp" / "log").write_text("hello from the pod\n")
    await call(client, "POST", PODS, pod("lp"))
    assert await call(client, "GET", f"{PODS}/lp/log") == (200, "hello from the pod\n")
    await asyncio.sleep(0)


async def test_built_in_kinds_are_decoded_and_namespaces_must_exist(server: Any) -> None:
    _, client, _ = server
    configmaps, secrets_ = "/api/v1/namespaces/default/configmaps", "/api/v1/namespaces/default/secrets"
    status, body = await call(client, "POST", configmaps, {"metadata": {"name": "c"}, "data": {"a": 1}})
    assert status == 400 and "ConfigMap.data.a of type string" in body["message"]
    status, body = await call(client, "POST", secrets_, {"metadata": {"name": "s"}, "data": {"a": "no!"}})
    assert status == 400 and "illegal base64 data in data.a" in body["message"]
    status, body = await call(
        client, "POST", "/api/v1/namespaces/nope/configmaps", {"metadata": {"name": "c"}}
    )
    assert status == 404 and body["message"] == 'namespaces "nope" not found'
    assert (await call(client, "POST", "/api/v1/namespaces", {"metadata": {"name": "nope"}}))[0] == 201
    assert (await call(client, "POST", "/api/v1/namespaces/nope/configmaps", {"metadata": {"name": "c"}}))[
        0
    ] == 201
    # What a real server fills in: a Secret's default type; no generation where there is no spec to count.
    status, secret = await call(client, "POST", secrets_, {"metadata": {"name": "s"}, "data": {"a": "eQ=="}})
    assert status == 201 and secret["type"] == "Opaque" and "generation" not in secret["metadata"]
    _, made = await call(client, "GET", "/api/v1/namespaces/nope/configmaps/c")
    assert "generation" not in made["metadata"]
    _, worker = await call(client, "POST", PODS, pod("counted"))
    assert worker["metadata"]["generation"] == 1


async def test_a_new_pod_is_pending_with_its_qos_class_before_any_kubelet_sees_it(server: Any) -> None:
    """kube-apiserver sets a pod's status on create (phase Pending, the QoS class of its resources) and drops
    what the client sent: a client listing pods right after creating them reads `status.phase` (an operator
    test once read a pod the kubelet had not yet reached and found no status at all)."""
    _, client, _ = server

    def sized(name: str, *resources: dict[str, Any]) -> dict[str, Any]:
        body = pod(name)
        body["spec"]["containers"] = [
            {"name": f"c{i}", "image": "i", "resources": r} for i, r in enumerate(resources)
        ]
        body["status"] = {"phase": "Running"}
        return body

    exact = {"limits": {"cpu": "2", "memory": "1Gi"}}
    cases = {
        "best-effort": (sized("best-effort", {}), "BestEffort"),
        "guaranteed": (sized("guaranteed", exact, {**exact, "requests": {"cpu": "2"}}), "Guaranteed"),
        "less-asked": (sized("less-asked", {**exact, "requests": {"cpu": "1"}}), "Burstable"),
        "one-limited": (sized("one-limited", exact, {}), "Burstable"),
        "gpu-only": (sized("gpu-only", {"limits": {"nvidia.com/gpu": 1}}), "BestEffort"),
    }
    for name, (body, qos) in cases.items():
        status, made = await call(client, "POST", PODS, body)
        assert status == 201 and made["status"] == {"phase": "Pending", "qosClass": qos}, (
            name,
            made["status"],
        )
        _, read = await call(client, "GET", f"{PODS}/{name}")
        assert read["status"] == made["status"]


async def test_a_secrets_string_data_is_stored_in_its_data_and_tables_count_keys(server: Any) -> None:
    """`stringData` is write-only: a real server stores it base64 in `data`, where the operator reads the
    Redis password; `kubectl get secrets,configmaps,services` prints what kube-apiserver computes."""
    _, client, _ = server
    secrets_ = "/api/v1/namespaces/default/secrets"
    body = {
        "metadata": {"name": "redis-auth"},
        "data": {"user": "cmpvYg=="},
        "stringData": {"password": "p4ss"},
    }
    status, made = await call(client, "POST", secrets_, body)
    assert status == 201 and "stringData" not in made
    assert made["data"] == {"user": "cmpvYg==", "password": base64.b64encode(b"p4ss").decode()}
    status, patched = await call(
        client,
        "PATCH",
        f"{secrets_}/redis-auth",
        {"stringData": {"password": "n3w"}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert status == 200 and "stringData" not in patched
    assert base64.b64decode(patched["data"]["password"]) == b"n3w" and patched["data"]["user"] == "cmpvYg=="
    await call(
        client,
        "POST",
        "/api/v1/namespaces/default/configmaps",
        {"metadata": {"name": "c"}, "data": {"a": "1"}},
    )
    service = {"metadata": {"name": "redis"}, "spec": {"ports": [{"port": 6379}], "selector": {"app": "r"}}}
    await call(client, "POST", "/api/v1/namespaces/default/services", service)
    table_accept = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}

    async def printed(plural: str) -> dict[str, dict[str, Any]]:
        _, table = await call(client, "GET", f"/api/v1/namespaces/default/{plural}", headers=table_accept)
        names = [c["name"] for c in table["columnDefinitions"]]
        return {row["cells"][0]: dict(zip(names, row["cells"], strict=True)) for row in table["rows"]}

    secret_row = (await printed("secrets"))["redis-auth"]
    assert (secret_row["Type"], secret_row["Data"]) == ("Opaque", 2) and "Age" in secret_row
    assert (await printed("configmaps"))["c"]["Data"] == 1
    service_row = (await printed("services"))["redis"]
    assert (service_row["Type"], service_row["Port(s)"]) == ("ClusterIP", "6379/TCP")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(number: int, value: bytes | int | str) -> bytes:
    """One protobuf field: an int as a varint, a str or bytes length-delimited."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _entry(number: int, key: str, value: bytes | str) -> bytes:
    return _field(number, _field(1, key) + _field(2, value))


def _kubernetes_protobuf(kind: str, raw: bytes) -> bytes:
    """What kubectl's typed commands send: the magic, then runtime.Unknown{typeMeta, raw}."""
    return b"k8s\x00" + _field(1, _field(1, "v1") + _field(2, kind)) + _field(2, raw)


async def test_protobuf_bodies_of_kubectls_typed_commands_are_read(server: Any) -> None:
    _, client, _ = server
    protobuf = {"Content-Type": "application/vnd.kubernetes.protobuf"}
    # ObjectMeta with the empty fields kubectl sends (namespace "", an empty creationTimestamp).
    meta = _field(1, "team-a") + _field(3, "") + _field(8, b"") + _entry(11, "team", "ml")
    created = await client.post(
        "/api/v1/namespaces", data=_kubernetes_protobuf("Namespace", _field(1, meta)), headers=protobuf
    )
    assert created.status == 201, await created.text()
    status, namespace = await call(client, "GET", "/api/v1/namespaces/team-a")
    assert status == 200 and namespace["metadata"]["labels"] == {"team": "ml"}
    assert namespace["status"] == {"phase": "Active"} and "namespace" not in namespace["metadata"]

    binary = bytes(range(256))
    secret = _field(1, _field(1, "token")) + _entry(2, "blob", binary) + _field(3, "Opaque")
    secret += _field(5, 1)  # immutable: true
    created = await client.post(
        "/api/v1/namespaces/team-a/secrets", data=_kubernetes_protobuf("Secret", secret), headers=protobuf
    )
    assert created.status == 201, await created.text()
    _, stored = await call(client, "GET", "/api/v1/namespaces/team-a/secrets/token")
    assert base64.b64decode(stored["data"]["blob"]) == binary
    assert stored["type"] == "Opaque" and stored["immutable"] is True

    configmap = _field(1, _field(1, "settings")) + _entry(2, "a", "é") + _entry(3, "bin", b"\xff\x00")
    created = await client.post(
        "/api/v1/namespaces/team-a/configmaps",
        data=_kubernetes_protobuf("ConfigMap", configmap),
        headers=protobuf,
    )
    assert created.status == 201, await created.text()
    _, stored = await call(client, "GET", "/api/v1/namespaces/team-a/configmaps/settings")
    assert stored["data"] == {"a": "é"} and stored["binaryData"] == {
        "bin": base64.b64encode(b"\xff\x00").decode()
    }

    # A kind this server cannot read as protobuf, and a truncated body: 415 saying to send JSON.
    pod_body = _kubernetes_protobuf("Pod", _field(1, _field(1, "p")))
    not_text = _kubernetes_protobuf("Secret", _field(1, _field(1, b"\xff\xfe")))
    for body in (pod_body, _kubernetes_protobuf("Secret", secret)[:-3], not_text):
        refused = await client.post("/api/v1/namespaces/team-a/pods", data=body, headers=protobuf)
        assert refused.status == 415 and "send it as JSON" in (await refused.json())["message"]


async def test_strict_field_validation_names_an_unknown_field_before_a_missing_one(server: Any) -> None:
    _, client, _ = server
    manifest = job_manifest("misspelt")
    manifest["spec"]["nodez"] = manifest["spec"].pop("nodes")
    jobs = rjob_path()
    status, body = await call(client, "POST", f"{jobs}?fieldValidation=Strict", manifest)
    assert status == 400 and 'strict decoding error: unknown field "spec.nodez"' in body["message"]
    status, body = await call(client, "POST", jobs, manifest)  # without Strict: pruned, then invalid
    assert status == 422 and "spec.nodes: Required value" in body["message"]


async def test_a_deleted_namespace_takes_what_is_in_it_and_waits_for_its_finalizers(server: Any) -> None:
    _, client, _ = server
    assert (await call(client, "POST", "/api/v1/namespaces", {"metadata": {"name": "gone"}}))[0] == 201
    base = "/api/v1/namespaces/gone"
    assert (await call(client, "POST", f"{base}/configmaps", {"metadata": {"name": "c"}}))[0] == 201
    held = pod("held", finalizers=["example.com/cleanup"])
    assert (await call(client, "POST", f"{base}/pods", held))[0] == 201
    assert (await call(client, "POST", PODS, pod("elsewhere")))[0] == 201

    status, body = await call(client, "DELETE", "/api/v1/namespaces/gone")
    assert status == 200 and body["status"]["phase"] == "Terminating"
    assert (await call(client, "GET", f"{base}/configmaps/c"))[0] == 404
    _, stuck = await call(client, "GET", f"{base}/pods/held")
    assert stuck["metadata"]["deletionTimestamp"]  # held by its finalizer, and the namespace with it
    _, namespace = await call(client, "GET", "/api/v1/namespaces/gone")
    assert namespace["status"]["phase"] == "Terminating"
    status, body = await call(client, "POST", f"{base}/configmaps", {"metadata": {"name": "late"}})
    assert status == 403 and "because it is being terminated" in body["message"]

    patch = {"metadata": {"finalizers": []}}
    headers = {"Content-Type": "application/merge-patch+json"}
    async with client.patch(f"{base}/pods/held", json=patch, headers=headers) as response:
        assert response.status == 200
    assert (await call(client, "GET", "/api/v1/namespaces/gone"))[0] == 404  # empty: gone
    assert (await call(client, "GET", f"{PODS}/elsewhere"))[0] == 200  # other namespaces untouched
    # As a real API server: the system namespaces may not be deleted.
    status, body = await call(client, "DELETE", "/api/v1/namespaces/default")
    assert (
        status == 403
        and body["message"] == 'namespaces "default" is forbidden: this namespace may not be deleted'
    )
    assert (await call(client, "GET", f"{PODS}/elsewhere"))[0] == 200


def test_a_pods_status_column_is_what_kube_apiserver_prints() -> None:
    from resilientjob.localstack._local_api_tables import _pod_status

    def pod(phase: str, state: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        containers = [{"name": "worker", "state": state}] if state is not None else []
        return {
            "metadata": extra.pop("metadata", {}),
            "status": {"phase": phase, "containerStatuses": containers, **extra},
        }

    assert _pod_status(pod("Pending")) == "Pending"
    assert _pod_status(pod("Running", {"running": {}})) == "Running"
    assert (
        _pod_status(pod("Succeeded", {"terminated": {"exitCode": 0, "reason": "Completed"}})) == "Completed"
    )
    assert _pod_status(pod("Failed", {"terminated": {"exitCode": 3, "reason": "Error"}})) == "Error"
    assert _pod_status(pod("Failed", {"terminated": {"exitCode": 137}})) == "ExitCode:137"
    assert _pod_status(pod("Pending", {"waiting": {"reason": "CrashLoopBackOff"}})) == "CrashLoopBackOff"
    assert _pod_status(pod("Failed", reason="Evicted")) == "Evicted"
    deleting = {"deletionTimestamp": "2026-11-29T00:00:00Z"}
    assert _pod_status(pod("Running", {"running": {}}, metadata=deleting)) == "Terminating"
    assert _pod_status(pod("Running", metadata=deleting, reason="NodeLost")) == "Unknown"
