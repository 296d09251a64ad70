"""The committed CRD equals the generator's output and is a valid CustomResourceDefinition."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from resilientjob.operator import api
from resilientjob.operator.crd import CRD_FILE, crd_manifest, crd_yaml
from resilientjob.planner.errors import PlannerError

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_the_generator() -> None:
    assert (ROOT / CRD_FILE).read_text() == crd_yaml(), "run scripts/gen_crds.py"


def test_crd_is_a_valid_customresourcedefinition() -> None:
    manifest = yaml.safe_load((ROOT / CRD_FILE).read_text())
    kubernetes_validate.validate(manifest, "1.30", strict=True)


def _walk(node: object, path: str = ""):  # type: ignore[no-untyped-def]
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}/{index}")


def test_schema_is_structural() -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema["properties"]["spec"]):
        if node.get("x-kubernetes-int-or-string"):
            # The one union a structural schema allows (a quantity), written as Kubernetes writes its own.
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}] and "type" not in node, path
            continue
        if path.rsplit("/", 2)[-2:-1] == ["anyOf"]:
            continue
        # No open object (a pod's affinity is typed as Kubernetes types it), and no map whose keys a
        # structural schema cannot state.
        assert "propertyNames" not in node, path
        assert (
            "$ref" not in node and "anyOf" not in node and "x-kubernetes-preserve-unknown-fields" not in node
        ), path
        if path.endswith(("properties", "x-kubernetes-validations")) or "/x-kubernetes-validations/" in path:
            continue
        if "/properties/" in path or path == "" or path.endswith("items"):
            assert "type" in node, f"no type at {path}"


def test_every_field_says_what_it_is_for_kubectl_explain() -> None:
    """`kubectl explain resilientjob.spec.<field>` prints the schema's description: none was `<empty>`."""

    def undescribed(node: dict[str, object], path: str) -> list[str]:
        found = []
        for name, child in (node.get("properties") or {}).items():  # type: ignore[attr-defined]
            here = f"{path}.{name}"
            if not child.get("description"):
                found.append(here)
            found += undescribed(child, here)
            if isinstance(child.get("items"), dict):
                found += undescribed(child["items"], f"{here}[]")
        return found

    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert undescribed(schema["properties"]["spec"], "spec") == []
    assert undescribed(schema["properties"]["status"], "status") == []


def test_schema_has_defaults_bounds_immutability_and_columns() -> None:
    version = crd_manifest()["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["policy"]["default"] == "auto"
    assert set(spec["properties"]["policy"]["enum"]) == {
        "auto",
        "reroute",
        "dynamic",
        "templates",
        "checkpoint",
    }
    assert spec["properties"]["nodes"]["minimum"] == 1
    for field in ("model", "data", "training", "output", "volumes"):
        assert spec["properties"][field]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf", field
    assert spec["properties"]["checkpoint"]["properties"]["intervalSteps"]["minimum"] == 0
    assert spec["properties"]["training"]["properties"]["precision"]["enum"] == ["fp32", "bf16"]
    assert {"image", "model", "nodes", "globalBatchSize", "microBatchSize"} <= set(spec["required"])
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Workers",
        "Reason",
        "Layout",
        "Throughput",
        "Step",
        "Loss",
        "Gen",
        "Age",
        "Last-Change",
    ]
    assert crd_manifest()["spec"]["names"]["shortNames"] == ["rjob"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"nodes": 0}, "spec.nodes"),
        ({"faultTolerance": 4}, "spec.faultTolerance"),
        ({"globalBatchSize": 10, "microBatchSize": 3}, "spec.globalBatchSize"),
        ({"policy": "nope"}, "spec.policy"),
        ({"deviceResource": "amd.com/gpu"}, "spec.deviceResource"),
        ({"model": "not-a-profile"}, "spec.model"),
        ({"profile": {"measure": True, "inline": []}}, "spec.profile"),
        ({"model": "bert-large"}, "spec.model"),
        ({"model": "synthetic:uniform-8"}, "spec.model"),
        ({"training": {"precision": "bf16"}}, "spec.training.precision"),
        ({"training": {"lrr": 0.1}}, "spec.training.lrr"),
        ({"training": {"betas": [0.9, 1.5]}}, "spec.training"),
        ({"data": {"format": "tokens"}}, "spec.data"),
        ({"data": {"path": "/d", "dtype": "int8"}}, "spec.data.dtype"),
        ({"model": "gpt", "output": {"path": "/out"}}, "spec.output"),
        ({"model": "hf:/models/m", "output": {"path": "/models/m/"}}, "spec.output.path"),
        ({"volumes": [{"name": "Bad_Name", "claimName": "c", "mountPath": "/m"}]}, "spec.volumes"),
        ({"volumes": [{"name": "a", "claimName": "c", "mountPath": "/m"}] * 2}, "spec.volumes.1.name"),
        ({"volumes": [{"name": "a", "claimName": "c", "mountPath": "/tmp"}]}, "spec.volumes.0.mountPath"),
        ({"profile": {"measure": True}, "model": "synthetic:llama2-7b"}, "spec.profile.measure"),
    ],
)
def test_parse_spec_names_the_field(change: dict[str, object], field: str) -> None:
    spec = {
        "image": "x",
        "model": "llama2-7b",
        "nodes": 4,
        "globalBatchSize": 8,
        "microBatchSize": 1,
        **change,
    }
    with pytest.raises(PlannerError) as caught:
        api.parse_spec(spec)
    assert caught.value.field.startswith(field), caught.value.field


def test_parse_spec_applies_defaults() -> None:
    spec = api.parse_spec(
        {"image": "x", "model": "llama2-7b", "nodes": 4, "globalBatchSize": 8, "microBatchSize": 1}
    )
    assert (
        spec.policy == "auto"
        and spec.fault_tolerance == 1
        and spec.device_resource is api.DeviceResource.NONE
    )
    assert spec.fail_slow.enabled and spec.checkpoint.interval_s == 1800


def test_worker_pods_carry_the_workload_the_agent_accepts() -> None:
    from resilientjob.operator._manifests import pod_manifest
    from resilientjob.protocol.workload import WORKLOAD_ENV, load_workload

    manifest = {
        "image": "x",
        "model": "hf:/models/tiny",
        "profile": {"inline": [{"forwardS": 1, "backwardS": 2, "paramBytes": 1, "optimizerBytes": 2,
                                "activationBytes": 1}] * 3},
        "nodes": 2,
        "globalBatchSize": 8,
        "microBatchSize": 1,
        "deviceResource": "nvidia.com/gpu",
        "data": {"path": "/data/tokens.bin", "seqLen": 128},
        "training": {"steps": 7, "precision": "bf16", "schedule": "cosine"},
        "output": {"path": "/out"},
        "checkpoint": {"path": "/ckpt", "intervalSteps": 5},
        "volumes": [{"name": "data", "claimName": "corpus", "mountPath": "/data", "readOnly": True}],
    }  # fmt: skip
    spec = api.parse_spec(manifest)
    body = {"metadata": {"name": "job", "namespace": "ns", "uid": "u"}}
    pod = pod_manifest(body, spec, 1, 0, "DP1 PP[2]", "redis://r:6379")
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    workload = load_workload(env[WORKLOAD_ENV])
    assert workload.model == "hf:/models/tiny" and workload.device == "cuda"
    assert workload.data.path == "/data/tokens.bin" and workload.data.seq_len == 128
    assert workload.training.steps == 7 and workload.training.precision == "bf16"
    assert workload.output is not None and workload.output.path == "/out"
    assert workload.checkpoint.path == "/ckpt" and workload.checkpoint.interval_steps == 5
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/data"]["readOnly"] is True
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert "corpus" in claims
