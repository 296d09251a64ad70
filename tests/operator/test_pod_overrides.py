"""`spec.podOverrides`: a job places and configures its own pods (node pool, tolerations, affinity,
environment, CPU and memory, pull secrets, service account, labels) over the operator's cluster-wide
defaults, and a pod the API server refuses is said in an Event and tried again, not a traceback a second."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from _rjob_stack import (
    REAL_CLUSTER,
    Stack,
    api_server,
    emulator_only,
    eventually,
    job_manifest,
    set_pod_phase,
)
from _support import free_port, job_object, rjob_local, rjob_ok, until

from resilientjob.operator import api
from resilientjob.operator._manifests import STORE_RESOURCES, pod_manifest, store_pod_manifest
from resilientjob.operator._pods import WorkerPods
from resilientjob.operator._worker_defaults import WorkerDefaults
from resilientjob.operator.kube import KubeApi, KubeError
from resilientjob.planner.errors import PlannerError

AFFINITY = {
    "podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 50,
                "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": {"team": "llm"}},
                },
            }
        ]
    }
}
OVERRIDES: dict[str, Any] = {
    "labels": {"team": "llm"},
    "annotations": {"example.com/cost-centre": "42"},
    "nodeSelector": {"gpu": "h100", "pool": "training"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": AFFINITY,
    "priorityClassName": "training-high",
    "serviceAccountName": "trainer",
    "imagePullSecrets": [{"name": "regcred"}],
    "env": [
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "TMPDIR", "value": "/scratch"},
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}},
        {"name": "RUN_NAME", "valueFrom": {"configMapKeyRef": {"name": "run", "key": "name"}}},
    ],
    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
}
ROOT = Path(__file__).resolve().parents[2]
BASE = {"image": "x", "model": "llama2-7b", "nodes": 4, "globalBatchSize": 8, "microBatchSize": 1}
BODY = {"metadata": {"name": "llm", "namespace": "team", "uid": "u"}}


def _spec(**overrides: Any) -> api.ResilientJobSpec:
    return api.parse_spec({**BASE, "deviceResource": "nvidia.com/gpu", "gpusPerNode": 8, **overrides})


def test_worker_pods_carry_the_overrides_and_the_store_pod_what_places_it() -> None:
    spec = _spec(podOverrides=OVERRIDES)
    worker = pod_manifest(BODY, spec, 1, 0, "DP4 PP[1,1,1,1]", "redis://r:6379/0")
    meta, pod = worker["metadata"], worker["spec"]
    assert meta["labels"]["team"] == "llm" and meta["labels"]["resilientjob.io/node"] == "1"
    assert meta["annotations"]["example.com/cost-centre"] == "42"
    assert meta["annotations"]["resilientjob.io/generation"] == "0"  # the operator's own stay
    assert pod["nodeSelector"] == {"gpu": "h100", "pool": "training"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"] == AFFINITY
    assert pod["priorityClassName"] == "training-high" and pod["serviceAccountName"] == "trainer"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    container = pod["containers"][0]
    env = {item["name"]: item for item in container["env"]}
    assert len(env) == len(container["env"])  # TMPDIR replaced in place, not given twice
    assert env["TMPDIR"] == {"name": "TMPDIR", "value": "/scratch"}
    assert env["NCCL_DEBUG"]["value"] == "INFO" and env["RJOB_NODE"]["value"] == "1"
    assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "wandb",
        "key": "key",
        "optional": False,
    }
    assert env["RUN_NAME"]["valueFrom"]["configMapKeyRef"]["name"] == "run"
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "8"},  # the accelerators stay the job's count
    }

    store = store_pod_manifest(BODY, spec, "redis://r:6379/0")
    meta, pod = store["metadata"], store["spec"]
    assert meta["labels"]["team"] == "llm" and meta["labels"]["resilientjob.io/role"] == "store"
    assert pod["nodeSelector"] == {"gpu": "h100", "pool": "training"} and pod["tolerations"]
    assert pod["serviceAccountName"] == "trainer" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["priorityClassName"] == "training-high"
    # No training code runs there: no worker sizing, placement among workers or environment.
    container = pod["containers"][0]
    assert "affinity" not in pod and container["resources"] == STORE_RESOURCES  # its own size only
    assert not {"NCCL_DEBUG", "WANDB_API_KEY"} & {item["name"] for item in container["env"]}

    plain = pod_manifest(BODY, _spec(), 1, 0, "DP4 PP[1,1,1,1]", "redis://r:6379/0")
    for field in ("nodeSelector", "tolerations", "affinity", "serviceAccountName", "imagePullSecrets"):
        assert field not in plain["spec"], field


def test_the_cluster_defaults_give_way_to_the_job() -> None:
    defaults = WorkerDefaults.model_validate(
        {
            "nodeSelector": {"pool": "shared", "arch": "amd64"},
            "tolerations": [{"key": "shared", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {"x": 1}},
            "priorityClassName": "default-low",
            "resources": {
                "requests": {"cpu": "4", "ephemeral-storage": "10Gi"},
                "limits": {"memory": "32Gi", "cpu": "16"},
            },
            "env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "HF_HOME", "value": "/cache"}],
        }
    )
    worker = defaults.apply(pod_manifest(BODY, _spec(podOverrides=OVERRIDES), 0, 0, "L", "redis://r:6379/0"))
    pod, container = worker["spec"], worker["spec"]["containers"][0]
    assert pod["nodeSelector"] == {"pool": "training", "arch": "amd64", "gpu": "h100"}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "shared"]
    assert pod["affinity"] == AFFINITY and pod["priorityClassName"] == "training-high"
    # What the job sizes is the job's in both kinds: no default limit of 32Gi under its 64Gi request, no
    # default CPU limit beside its CPU request (a pod the API server would refuse, or one it never sized).
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "ephemeral-storage": "10Gi"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "8"},
    }
    env = [item for item in container["env"] if item["name"] in ("NCCL_DEBUG", "HF_HOME")]
    assert env == [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "HF_HOME", "value": "/cache"}]


def test_an_affinity_of_every_kind_reaches_the_pods_as_written() -> None:
    """Typed as Kubernetes types it, and laid on the worker pods as the user wrote it: nothing added, no
    empty list or null for what was not given."""
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                           "values": ["NVIDIA-H100-80GB-HBM3"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["bad-node"]}]},
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchExpressions": [{"key": "cpus", "operator": "Gt",
                                                                   "values": ["64"]}]}}
            ],
        },
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "topology.kubernetes.io/zone", "labelSelector": {},
                 "namespaceSelector": {"matchLabels": {"team": "llm"}}}
            ]
        },
        **AFFINITY,
    }  # fmt: skip
    spec = _spec(podOverrides={"affinity": affinity})
    worker = pod_manifest(BODY, spec, 1, 0, "DP4 PP[1,1,1,1]", "redis://r:6379/0")
    assert worker["spec"]["affinity"] == affinity
    assert (
        api.ResilientJobSpec.model_validate(spec.model_dump(by_alias=True)).pod_overrides
        == spec.pod_overrides
    )


@pytest.mark.parametrize(
    ("overrides", "field", "said"),
    [
        ({"env": [{"name": "RJOB_NODE", "value": "1"}]}, "spec.podOverrides.env.0", "set by the operator"),
        ({"env": [{"name": "POD_IP", "value": "1"}]}, "spec.podOverrides.env.0", "set by the operator"),
        ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "spec.podOverrides", "twice"),
        ({"env": [{"name": "A"}]}, "spec.podOverrides.env.0", "exactly one of value and valueFrom"),
        ({"env": [{"name": "A", "valueFrom": {}}]}, "spec.podOverrides.env.0.valueFrom", "exactly one"),
        ({"labels": {"resilientjob.io/job": "x"}}, "spec.podOverrides.labels", "the operator's"),
        ({"labels": {"team": "not a value"}}, "spec.podOverrides.labels", "not a valid label value"),
        ({"nodeSelector": {"bad key!": "x"}}, "spec.podOverrides.nodeSelector", "not a valid label key"),
        ({"annotations": {"resilientjob.io/layout": "x"}}, "spec.podOverrides.annotations", "the operator's"),
        ({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
         "spec.podOverrides.tolerations.0", "must be empty"),
        ({"tolerations": [{"value": "v"}]}, "spec.podOverrides.tolerations.0", "must be Exists"),
        ({"tolerations": [{"key": "a b"}]}, "spec.podOverrides.tolerations.0", "not a qualified name"),
        ({"tolerations": [{"key": "k", "value": "a b"}]}, "spec.podOverrides.tolerations.0", "label value"),
        ({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "a/b"}}}]},
         "spec.podOverrides.env.0.valueFrom.secretKeyRef.key", "pattern"),
        ({"tolerations": [{"key": "k", "tolerationSeconds": 5}]}, "spec.podOverrides.tolerations.0",
         "NoExecute"),
        ({"affinity": {"nodeAfinity": {}}}, "spec.podOverrides.affinity.nodeAfinity", "unknown field"),
        ({"affinity": {"nodeAffinity": {"requiredDuringScheduling": {}}}},
         "spec.podOverrides.affinity.nodeAffinity.requiredDuringScheduling", "unknown field"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In"}]}]}}}},
         "spec.podOverrides.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
         ".nodeSelectorTerms.0.matchExpressions.0", "In needs at least one value"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{}]}}}},
         "spec.podOverrides.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution",
         "nodeSelectorTerms.0: give matchExpressions or matchFields"),
        ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 0, "preference": {"matchExpressions": [{"key": "a", "operator": "Exists"}]}}]}}},
         "spec.podOverrides.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution.0.weight",
         "greater than or equal to 1"),
        ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 5, "preference": {"matchExpressions": [{"key": "cores", "operator": "Gt",
                                                             "values": ["many"]}]}}]}}},
         "spec.podOverrides.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution.0"
         ".preference.matchExpressions.0", "Gt takes one integer"),
        ({"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"team": "llm"}}}]}}},
         "spec.podOverrides.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution.0"
         ".topologyKey", "Field required"),
        ({"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "zone", "labelSelector": {"matchExpressions": [
                {"key": "team", "operator": "Exists", "values": ["llm"]}]}}]}}},
         "spec.podOverrides.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution.0"
         ".labelSelector.matchExpressions.0", "must be empty with Exists"),
        ({"resources": {"limits": {"nvidia.com/gpu": 2}}}, "spec.podOverrides.resources.limits",
         "spec.gpusPerNode"),
        ({"resources": {"requests": {"cpu": "8 cores"}}}, "spec.podOverrides.resources.requests",
         "not a quantity"),
        ({"resources": {"requests": {"cpu": "1.5"}, "limits": {"cpu": "1200m"}}},
         "spec.podOverrides.resources", "more than its limit"),
        ({"resources": {"requests": {"memory": "2e9"}, "limits": {"memory": "1Gi"}}},
         "spec.podOverrides.resources", "more than its limit"),
        ({"resources": {"requests": {"memory": "64Gi"}, "limits": {"memory": "32Gi"}}},
         "spec.podOverrides.resources", "more than its limit"),
        ({"priorityClassName": "High"}, "spec.podOverrides.priorityClassName", "not a valid object name"),
        ({"serviceAccountName": "a_b"}, "spec.podOverrides.serviceAccountName", "not a valid object name"),
        ({"imagePullSecrets": ["regcred"]}, "spec.podOverrides.imagePullSecrets.0", ""),
        ({"nodeSelectors": {}}, "spec.podOverrides.nodeSelectors", ""),
    ],
)  # fmt: skip
def test_bad_overrides_are_refused_naming_the_field(overrides: dict[str, Any], field: str, said: str) -> None:
    with pytest.raises(PlannerError) as caught:
        _spec(podOverrides=overrides)
    assert caught.value.field == field and said in str(caught.value), (caught.value.field, str(caught.value))
    assert "\n" not in str(caught.value)


def _overrides_without_cluster_objects() -> dict[str, Any]:
    """The overrides a test cluster can take without objects it lacks (a real API server refuses pods of a
    PriorityClass that does not exist)."""
    overrides = copy.deepcopy(OVERRIDES)
    del overrides["priorityClassName"], overrides["serviceAccountName"]
    return overrides


@pytest.fixture
def quick_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator (started by `stack` after this) tries refused pods again after 1 s, not 30."""
    monkeypatch.setenv("RJOB_PODS_REFUSED_RETRY_S", "1")


@pytest.fixture
def metrics_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """The operator (started by `stack` after this) serves its Prometheus metrics on this port."""
    port = free_port()
    monkeypatch.setenv("RJOB_METRICS_PORT", str(port))
    return port


def _not_ready(port: int, job: str) -> list[str]:
    """The reasons of the operator's `rjob_workers_not_ready` series of `job` whose value is 1."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.findall(r"^rjob_workers_not_ready\{(.*)\} 1\.0$", text, re.MULTILINE)
    return sorted(
        re.search(r'reason="([^"]*)"', labels)[1]  # type: ignore[index]
        for labels in found
        if f'rjob="{job}"' in labels
    )


@pytest.mark.cluster
async def test_the_api_server_keeps_the_overrides_and_a_refused_pod_waits_for_its_account(
    quick_retry: None, metrics_port: int, stack: Stack
) -> None:
    kube = stack.kube
    overrides = _overrides_without_cluster_objects()
    assert await kube.create_job(job_manifest("placed", podOverrides=overrides)) is None

    async def pods(job: str) -> list[dict[str, Any]] | None:
        found = await kube.job_pods(job)
        return found if len(found) == 4 else None

    created = await eventually(lambda: pods("placed"), 20, "4 pods")
    stored = await kube.get(api.PLURAL, "placed")
    assert stored is not None
    # The CRD keeps the affinity as given (an open object in its schema: nothing pruned).
    assert stored["spec"]["podOverrides"]["affinity"] == AFFINITY
    for pod in created:
        assert pod["spec"]["nodeSelector"] == {"gpu": "h100", "pool": "training"}
        assert pod["spec"]["affinity"] == AFFINITY and pod["metadata"]["labels"]["team"] == "llm"
        env = {item["name"]: item for item in pod["spec"]["containers"][0]["env"]}
        assert env["NCCL_DEBUG"]["value"] == "INFO" and "secretKeyRef" in env["WANDB_API_KEY"]["valueFrom"]

    # A ServiceAccount that does not exist yet: the API server refuses the pods (403). One Warning Event
    # with its words; once the account exists, the next try creates them.
    account = {"serviceAccountName": "trainer-missing"}
    assert await kube.create_job(job_manifest("refused", podOverrides=account)) is None

    async def refused() -> str | None:
        events = [e for e in await kube.events_of("refused") if e.get("reason") == "PodsRefused"]
        return events[0]["message"] if events else None

    message = await eventually(refused, 20, "the PodsRefused Event")
    assert 'serviceaccount "trainer-missing" not found' in message and "\n" not in message, message
    await asyncio.sleep(2.5)  # two more tries at the 1 s retry, refused alike: no Event of their own
    told = [e for e in await kube.events_of("refused") if e.get("reason") == "PodsRefused"]
    assert len(told) == 1 and int(told[0].get("count") or 1) == 1, told
    assert await kube.job_pods("refused") == []
    status = await kube.job_status("refused")
    assert status.get("phase") == "Pending"  # not a blank row in kubectl get
    # The status keeps the cause (the Reason column) after the Event has expired.
    said = workers_ready(status)
    assert said[:2] == ("False", "PodsRefused") and 'serviceaccount "trainer-missing" not found' in said[2]
    # And the series the chart's ResilientJobWorkersNotRunning alert watches.
    assert _not_ready(metrics_port, "refused") == ["PodsRefused"]
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "trainer-missing"}}
    assert await kube.api.create(kube.path("serviceaccounts"), sa)
    made = await eventually(lambda: pods("refused"), 30, "the pods once the account exists")
    assert {pod["spec"]["serviceAccountName"] for pod in made} == {"trainer-missing"}

    async def no_longer_refused() -> tuple[str, str, str] | None:
        said = workers_ready(await kube.job_status("refused"))
        return said if said[1] not in ("", "PodsRefused") else None

    await eventually(no_longer_refused, 20, "WorkersReady past PodsRefused once the pods exist")

    async def series_moved_on() -> list[str] | None:
        reasons = _not_ready(metrics_port, "refused")
        return reasons if "PodsRefused" not in reasons and len(reasons) <= 1 else None

    await eventually(series_moved_on, 10, "one rjob_workers_not_ready series, past PodsRefused")
    if not REAL_CLUSTER:
        log = stack.operator.log.read_text()
        assert "Traceback" not in log, log[-5000:]


@pytest.mark.cluster
@emulator_only("the test sets pod phases itself, as the kubelet of a real cluster would")
async def test_a_refused_replacement_waits_while_the_job_trains_on(quick_retry: None, stack: Stack) -> None:
    """A replacement pod refused mid-training (its ServiceAccount deleted meanwhile) must not stop the job's
    loop: the failure is planned around as ever, the replacement waits in `status.capacity.waiting` and is
    asked for again, under a new id, once the account is back."""
    kube = stack.kube
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "runner"}}
    assert await kube.api.create(kube.path("serviceaccounts"), account)
    spec = {"failSlow": {"enabled": False}, "podOverrides": {"serviceAccountName": "runner"}}
    assert await kube.create_job(job_manifest("repl", **spec)) is None

    async def status_where(check: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        status = await kube.job_status("repl")
        return status if status and check(status) else None

    await eventually(lambda: status_where(lambda s: s.get("planGeneration") == 0), 20, "generation 0")
    for node in range(4):
        await set_pod_phase(kube, f"repl-node-{node}", "Running")
    assert await kube.delete("serviceaccounts", "runner")
    await kube.delete("pods", "repl-node-1")

    def waiting(status: dict[str, Any]) -> bool:
        return status.get("failedNodes") == [1] and bool((status.get("capacity") or {}).get("waiting"))

    status = await eventually(
        lambda: status_where(waiting), 15, "node 1 planned around, its replacement waiting"
    )
    assert status["planGeneration"] >= 1 and status["workersTotal"] == 3
    assert sorted(
        int(p["metadata"]["labels"]["resilientjob.io/node"]) for p in await kube.job_pods("repl")
    ) == [
        0,
        2,
        3,
    ]
    events = [e for e in await kube.events_of("repl") if e.get("reason") == "PodsRefused"]
    assert events and 'serviceaccount "runner" not found' in events[0]["message"]
    assert workers_ready(await kube.job_status("repl"))[1] == "PodsRefused"
    assert not [e for e in await kube.events_of("repl") if e.get("reason") == "ReplacementBackoff"]
    # The loop goes on meanwhile: another worker's death is still planned around.
    await kube.delete("pods", "repl-node-3")
    await eventually(
        lambda: status_where(lambda s: s.get("failedNodes") == [1, 3]), 15, "node 3 planned around"
    )
    await asyncio.sleep(2.5)  # its replacement, and node 1's again, refused alike under new pod names
    told = [e for e in await kube.events_of("repl") if e.get("reason") == "PodsRefused"]
    assert len(told) == 1 and int(told[0].get("count") or 1) == 1, [e["message"] for e in told]

    assert await kube.api.create(kube.path("serviceaccounts"), account)

    async def replaced() -> list[int] | None:
        nodes = sorted(
            int(p["metadata"]["labels"]["resilientjob.io/node"]) for p in await kube.job_pods("repl")
        )
        return nodes if len(nodes) == 4 else None

    nodes = await eventually(replaced, 20, "two replacement pods once the account is back")
    assert nodes[:2] == [0, 2] and min(nodes[2:]) >= 4, nodes  # new ids, never 1 or 3 again
    for node in nodes[2:]:
        await set_pod_phase(kube, f"repl-node-{node}", "Running")
    await eventually(
        lambda: status_where(lambda s: workers_ready(s)[:2] == ("True", "AllWorkersRunning")),
        20,
        "every worker pod running, the refusal forgotten",
    )
    log = stack.operator.log.read_text()
    assert "Traceback" not in log, log[-5000:]


def workers_ready(status: dict[str, Any]) -> tuple[str, str, str]:
    """(status, reason, message) of a job status's WorkersReady condition; empty strings when it has none."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "WorkersReady":
            return condition["status"], condition["reason"], condition.get("message", "")
    return "", "", ""


@pytest.mark.cluster
@emulator_only("the emulator's ServiceAccount admission refuses one pod of the batch and takes the other")
async def test_a_partly_refused_batch_reads_back_the_pods_the_server_took() -> None:
    """The API server takes some pods of a batch and refuses others: the refusal is raised, and the pods it
    took are in the job's view already, so replacements count them as made (`status.capacity.replaced`)
    and ask again only for the refused ones."""
    async with api_server() as (_, url):
        kube = KubeApi(kopf.ConnectionInfo(server=url, insecure=True, default_namespace="default"))
        try:
            pods = WorkerPods(kube, "default", "split", asyncio.Event())
            spec = _spec()
            body = {"metadata": {"name": "split", "namespace": "default", "uid": "u"}}
            taken = pod_manifest(body, spec, 4, 1, "DP4 PP[1,1,1,1]", "redis://r:6379/0")
            refused = pod_manifest(body, spec, 5, 1, "DP4 PP[1,1,1,1]", "redis://r:6379/0")
            refused["spec"]["serviceAccountName"] = "nobody"
            for manifest in (taken, refused):  # no job object here: its garbage collector would take them
                del manifest["metadata"]["ownerReferences"]
            seen: list[str] = []

            def observe(pod: dict[str, Any], deleted: bool) -> None:
                seen.append(pod["metadata"]["name"])
                pods.observe(pod, deleted)

            with pytest.raises(KubeError) as error:
                await pods.create([refused, taken], observe)
            assert error.value.status == 403 and 'serviceaccount "nobody" not found' in str(error.value)
            assert seen == ["split-node-4"] and set(pods.views) == {4}
        finally:
            await kube.close()


def _call(state: Path, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One request to the local stack's API server under `state`, as any client sends it."""
    api_url = json.loads((state / "state.json").read_text())["api_url"]
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        api_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


@pytest.mark.cluster
@pytest.mark.slow
@emulator_only("`rjob local` is the embedded stack: it starts its own emulator, Redis and kubelet")
def test_a_pod_whose_secret_is_missing_is_told_and_starts_once_it_exists(local: Path, tmp_path: Path) -> None:
    """The worker's env names a Secret that is not there: the kubelet keeps the container waiting
    (CreateContainerConfigError), as a node's does, and the operator says so in a `PodNotStarting` Warning
    (before, the job sat Pending with nothing in its Events). Once the Secret exists the pods start, and
    the process has the value."""
    manifest = yaml.safe_load((ROOT / "examples" / "local-cpu.yaml").read_text())
    secret_env = {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}}
    manifest["spec"]["podOverrides"] = {"env": [secret_env]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    rjob_ok(local, "apply", "-f", str(path))
    name = manifest["metadata"]["name"]

    def told() -> list[str] | None:
        events = _call(local, "GET", "/api/v1/namespaces/default/events")["items"]
        said = [e["message"] for e in events if e.get("reason") == "PodNotStarting"]
        return said or None

    said = until(told, 30, "a PodNotStarting Event")
    assert (
        f"pod {name}-node-" in said[0] and 'CreateContainerConfigError: secret "wandb" not found' in said[0]
    )
    pods = _call(local, "GET", "/api/v1/namespaces/default/pods")["items"]
    assert pods and all(p["status"]["phase"] == "Pending" for p in pods), [p["status"] for p in pods]

    # The job's status says it too (kubectl get rjob's Reason column), and `rjob local get` under its row.
    # Four pods meet the same missing Secret: the condition counts them as their kubelet says so (the first
    # pod's wait may be told before the others' on a slow host), and one Warning says it.
    def not_starting() -> tuple[str, str, str] | None:
        said = workers_ready(job_object(local, name).get("status") or {})
        return said if said[1] == "PodNotStarting" and "(and 3 more pods)" in said[2] else None

    stuck = until(not_starting, 30, "WorkersReady False, PodNotStarting for the four pods")
    assert stuck[0] == "False" and 'CreateContainerConfigError: secret "wandb" not found' in stuck[2]
    assert "PodNotStarting: pod " in rjob_ok(local, "get")
    assert len(told() or []) == 1, told()

    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "wandb"},
        "data": {"key": "czNjcmV0"},
    }
    _call(local, "POST", "/api/v1/namespaces/default/secrets", secret)
    until(lambda: job_object(local, name).get("status", {}).get("workers") == "4/4", 60, "4 workers running")
    until(
        lambda: workers_ready(job_object(local, name).get("status") or {})[1] == "AllWorkersRunning",
        20,
        "WorkersReady True",
    )
    # And its end is told too, for `kubectl get events`.
    events = _call(local, "GET", "/api/v1/namespaces/default/events")["items"]
    over = [e for e in events if e.get("reason") == "AllWorkersRunning"]
    assert over and over[0]["type"] == "Normal" and "(was PodNotStarting)" in over[0]["message"], over
    # The container's status says it runs now (kubectl's STATUS column), not the wait from before.
    started = _call(local, "GET", "/api/v1/namespaces/default/pods")["items"]
    assert all("running" in p["status"]["containerStatuses"][0]["state"] for p in started), started
    pids = [int(p.read_text()) for p in (local / "pods").glob(f"{name}-node-*/pid")]
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
    assert b"WANDB_API_KEY=s3cret" in environ
    # The example trains the synthetic loop: a break has no collective to act on, and says so.
    refused = rjob_local(local, "chaos", "break", f"{name}-node-1")
    assert refused.returncode == 2 and "runs the synthetic loop" in refused.stderr, refused
