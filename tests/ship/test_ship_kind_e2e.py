"""The operator installed by the Helm chart, on a real cluster (`make e2e-kind` sets RJOB_KUBECONFIG,
RJOB_E2E_IMAGE and RJOB_E2E_NAMESPACE). A job starts with generation 0 and its pods; deleting a pod gives
generation 1 without that node; deleting the job removes its pods. Skipped without a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from _chart import tool

pytestmark = pytest.mark.skipif(
    not (os.environ.get("RJOB_KUBECONFIG") and os.environ.get("RJOB_E2E_IMAGE")),
    reason="needs a cluster and the image loaded into it: make e2e-kind",
)
NAMESPACE = os.environ.get("RJOB_E2E_NAMESPACE", "default")


def kubectl(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [str(tool("kubectl")), "--kubeconfig", os.environ["RJOB_KUBECONFIG"], "-n", NAMESPACE, *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def until(probe: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def status(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(kubectl("get", "rjob", name, "-o", "json"))
    return body.get("status") or {}


def pods(name: str) -> list[str]:
    listing = json.loads(kubectl("get", "pods", "-l", f"resilientjob.io/job={name}", "-o", "json"))
    return sorted(
        p["metadata"]["name"] for p in listing["items"] if not p["metadata"].get("deletionTimestamp")
    )


def test_job_lifecycle_on_the_cluster() -> None:
    name = "e2e"
    layer = {
        "forwardS": 0.01,
        "backwardS": 0.02,
        "paramBytes": 2**20,
        "optimizerBytes": 2**21,
        "activationBytes": 2**18,
    }
    manifest = {
        "apiVersion": "resilientjob.io/v1alpha1",
        "kind": "ResilientJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "image": os.environ["RJOB_E2E_IMAGE"],
            "model": "synthetic:uniform-8",
            "profile": {"inline": [layer] * 8},
            "nodes": 3,
            "globalBatchSize": 12,
            "microBatchSize": 1,
            "faultTolerance": 1,
        },
    }
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    try:
        first = until(
            lambda: (s := status(name)).get("planGeneration") == 0 and s.get("phase") == "Running" and s,
            180,
            "generation 0",
        )
        assert pods(name) == [f"{name}-node-{n}" for n in range(3)]
        assert first["workersTotal"] == 3
        started = time.monotonic()
        kubectl("delete", "pod", f"{name}-node-1", "--wait=false")
        second = until(lambda: (s := status(name)).get("planGeneration") == 1 and s, 30, "generation 1")
        assert second["failedNodes"] == [1] and second["lastDecision"]["trigger"] == "NodeFailed"
        print(f"re-planned {time.monotonic() - started:.2f}s after the pod deletion")
        events = kubectl("get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json")
        assert any(e["reason"] in ("NodeFailed", "Replanned") for e in json.loads(events)["items"])
    finally:
        kubectl("delete", "rjob", name, "--wait=true", "--timeout=60s")
    until(lambda: not pods(name), 60, "the job's pods to go with it")
