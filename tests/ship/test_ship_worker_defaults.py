"""The chart's `workers` values reach the worker pods: rendered defaults load in the operator, merge into
the pods it creates, and the result is still a valid Pod."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _chart import CHART, objects, one, validate

from resilientjob.operator import api
from resilientjob.operator._manifests import STORE_RESOURCES, pod_manifest, store_pod_manifest
from resilientjob.operator._worker_defaults import WorkerDefaults
from resilientjob.planner import PlannerError


def _rendered_defaults(values: Path) -> dict[str, Any]:
    configmap = one(objects([values]), "ConfigMap", "rj-resilientjob-worker-defaults")
    data: dict[str, Any] = json.loads(configmap["data"]["worker-defaults.json"])
    return data


def _job_spec(device: str) -> api.ResilientJobSpec:
    return api.parse_spec(
        {
            "image": "example/worker:1",
            "model": "llama2-7b",
            "nodes": 4,
            "gpusPerNode": 8,
            "deviceResource": device,
            "globalBatchSize": 64,
            "microBatchSize": 1,
        }
    )


BODY = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u-1"}}


def _job_pod(device: str) -> dict[str, Any]:
    return pod_manifest(
        BODY, _job_spec(device), node=2, generation=0, layout="DP1 PP[4]", redis_url="redis://r:6379/0"
    )


@pytest.mark.parametrize(
    ("values", "device"), [("gpu", "nvidia.com/gpu"), ("ascend", "huawei.com/Ascend910")]
)
def test_chart_defaults_schedule_worker_pods(values: str, device: str) -> None:
    defaults = WorkerDefaults.model_validate(_rendered_defaults(CHART / "ci" / f"{values}-values.yaml"))
    pod = defaults.apply(_job_pod(device))
    spec = pod["spec"]
    container = spec["containers"][0]
    assert defaults.node_selector and spec["nodeSelector"] == defaults.node_selector
    assert any(t.get("key") == device for t in spec["tolerations"])
    # The job decides the accelerator count; the defaults never override it.
    assert container["resources"]["limits"][device] == "8"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    validate(pod)


def test_the_store_pod_runs_beside_the_workers_without_their_accelerator_or_size() -> None:
    rendered = _rendered_defaults(CHART / "ci" / "gpu-values.yaml")
    rendered["nodeSelector"]["kubernetes.io/arch"] = "arm64"  # the chart's workers.nodeSelector, say
    defaults = WorkerDefaults.model_validate(rendered)
    store = store_pod_manifest(BODY, _job_spec("nvidia.com/gpu"), "redis://r:6379/0")
    pod = defaults.apply(store, worker=False)
    spec_out, container = pod["spec"], pod["spec"]["containers"][0]
    assert spec_out["nodeSelector"] == {"kubernetes.io/arch": "arm64"} and "affinity" not in spec_out
    # Its own small size, not the workers' (the defaults asked for 8 CPUs and 64Gi on a GPU node before).
    assert container["resources"] == STORE_RESOURCES
    assert all(volume["name"] != "dshm" for volume in spec_out.get("volumes", []))
    # Still admitted where the workers are: their tolerations, priority and security contexts.
    assert spec_out["tolerations"] and spec_out["priorityClassName"] == "training-high"
    assert spec_out["securityContext"] == defaults.pod_security_context
    validate(pod)


def test_a_worker_or_store_that_dies_before_its_last_words_is_told_by_its_logs_tail() -> None:
    """A container that dies before it can write its termination message (a bad image, a missing module)
    leaves its log's tail there instead: the job's failure quotes it, after its pods are deleted."""
    store = store_pod_manifest(BODY, _job_spec("nvidia.com/gpu"), "redis://r:6379/0")
    for pod in (_job_pod("nvidia.com/gpu"), _job_pod("huawei.com/Ascend910"), store):
        assert pod["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
        validate(pod)


def test_an_ascend_worker_loads_canns_environment_before_the_agent() -> None:
    """A pod's `command` replaces the image's entry point, which sources CANN's set_env.sh on Ascend: the
    worker's command does it itself, then runs the agent with its arguments untouched."""
    command = _job_pod("huawei.com/Ascend910")["spec"]["containers"][0]["command"]
    assert command[:2] == ["sh", "-c"] and "/usr/local/Ascend/ascend-toolkit/set_env.sh" in command[2]
    assert command[-3:] == ["python", "-m", "resilientjob.agent"]
    # The wrapper runs (no CANN here: nothing to source) and hands every argument through.
    wrapped = [*command[:4], sys.executable, "-c", "import sys; print(sys.argv[1:])", "a b", "c"]
    assert subprocess.run(wrapped, capture_output=True, text=True, check=True).stdout == "['a b', 'c']\n"
    assert _job_pod("nvidia.com/gpu")["spec"]["containers"][0]["command"] == [
        "python",
        "-m",
        "resilientjob.agent",
    ]


def test_job_settings_win_over_defaults() -> None:
    defaults = WorkerDefaults.model_validate(
        {
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}},
            "env": [{"name": "RJOB_NODE", "value": "9"}],
        }
    )
    pod = defaults.apply(_job_pod("nvidia.com/gpu"))
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "memory": "64Gi"}
    assert [e["value"] for e in container["env"] if e["name"] == "RJOB_NODE"] == ["2"]


def test_bad_defaults_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "defaults.json"
    path.write_text(json.dumps({"nodeSelector": {"zone": 3}, "tolerations": []}))
    with pytest.raises(PlannerError) as info:
        WorkerDefaults.load(path)
    assert info.value.field.startswith("workers.nodeSelector")
    path.write_text("{")
    with pytest.raises(PlannerError, match="not JSON"):
        WorkerDefaults.load(path)
