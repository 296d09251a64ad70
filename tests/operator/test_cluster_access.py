"""How the tests and the operator reach a cluster: the kubeconfig login (the RJOB_KUBECONFIG mode) works end
to end against the emulator here; fail-stop signals that only a kubelet or node controller can produce are
written by hand (emulator only); admission-time schema validation needs a real API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _rjob_stack import (
    Kube,
    Stack,
    connection_from_kubeconfig,
    emulator_only,
    eventually,
    job_manifest,
    kubeconfig_for,
    real_cluster_only,
)

pytestmark = pytest.mark.cluster


@emulator_only("it writes a kubeconfig naming the emulator; on a cluster RJOB_KUBECONFIG is that kubeconfig")
async def test_a_client_logged_in_with_a_kubeconfig_sees_the_operator_work(
    stack: Stack, tmp_path: Path
) -> None:
    server = stack.kube.api.server
    info = connection_from_kubeconfig(str(kubeconfig_for(server, tmp_path / "kubeconfig")))
    assert info.server == server and info.default_namespace == "default"
    kube = Kube(info)
    try:
        assert await kube.create_job(job_manifest("viakubeconfig")) is None

        async def started() -> list[dict[str, Any]] | None:
            status = await kube.job_status("viakubeconfig")
            pods = await kube.job_pods("viakubeconfig")
            return pods if status.get("planGeneration") == 0 and len(pods) == 4 else None

        pods = await eventually(started, 20, "generation 0 seen through the kubeconfig login")
    finally:
        await kube.close()
    assert {p["metadata"]["annotations"]["resilientjob.io/generation"] for p in pods} == {"0"}


@emulator_only("it fakes the node controller by writing a pod's Ready condition; a kubelet would undo it")
async def test_node_not_ready_fences_the_pod_and_replans(stack: Stack) -> None:
    kube = stack.kube
    assert await kube.create_job(job_manifest("notready")) is None

    async def generation(g: int) -> dict[str, Any] | None:
        status = await kube.job_status("notready")
        return status if status.get("planGeneration") == g else None

    await eventually(lambda: generation(0), 20, "generation 0")
    condition = {"type": "Ready", "status": "False", "reason": "NodeNotReady"}
    await kube.api.patch(
        kube.path("pods", "notready-node-3", status=True),
        {"status": {"phase": "Running", "conditions": [condition]}},
    )
    status = await eventually(lambda: generation(1), 5, "generation 1 after node 3 went NotReady")
    assert status["failedNodes"] == [3] and status["lastDecision"]["trigger"] == "NodeFailed"
    assert "node lost" in status["lastDecision"]["reason"]
    assert "notready-node-3" not in {p["metadata"]["name"] for p in await kube.job_pods("notready")}


@real_cluster_only
async def test_the_api_server_refuses_schema_violations_at_admission(stack: Stack) -> None:
    error = await stack.kube.create_job(job_manifest("badpolicy", policy="teleport"))
    assert error is not None and error.status == 422 and "spec.policy" in str(error)
    assert await stack.kube.get("resilientjobs", "badpolicy") is None
