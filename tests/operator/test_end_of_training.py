"""A worker lost after the last step, while the trained model is written out, through the real operator
(emulated API server, real Redis; the test plays the kubelet and the agents' telemetry): the job is not
Succeeded while a pod of its plan has failed. The operator plans around the lost node, as at any failure,
and the plan it publishes (which the survivors read to write the lost node's layers: `agent._final_export`)
leaves the node out, and asks for no replacement. Once the survivors' pods complete, the job has succeeded."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from _rjob_stack import Stack, emulator_only, eventually, job_manifest, redis_client, set_pod_phase

from resilientjob.protocol.messages import ModelProfileReport, ModelProfileRequest

pytestmark = [
    pytest.mark.cluster,
    emulator_only("the test sets pod phases itself, as the kubelet of a real cluster would"),
]

STEPS = 40


async def test_a_worker_lost_while_the_model_is_written_is_planned_around(stack: Stack) -> None:
    from resilientjob.agent.telemetry import Telemetry

    kube = stack.kube
    manifest = job_manifest(
        "ending",
        model="mypkg.model:build",  # not a simulation: the job ends at training.steps
        training={"steps": STEPS},
        failSlow={"enabled": False},
    )
    await kube.create_job(manifest)

    async def status_where(check: Any) -> dict[str, Any] | None:
        status = await kube.job_status("ending")
        return status if status and check(status) else None

    client = await redis_client(stack.redis_url)
    keys = stack.keys("ending")
    # Node 0's pre-flight, as its agent answers it: the model built, with the profile's 8 layers.
    raw = await eventually(lambda: client.get(keys.profile_request), 20, "node 0's pre-flight request")
    request = ModelProfileRequest.model_validate_json(raw)
    report = ModelProfileReport(request=request, node=0, num_layers=8, sent_at=time.time())
    await client.set(keys.profile_report, report.model_dump_json())
    await eventually(lambda: status_where(lambda s: s.get("planGeneration") == 0), 20, "generation 0")
    for node in range(4):
        await set_pod_phase(kube, f"ending-node-{node}", "Running")
    agents = [Telemetry(client, stack.keys("ending"), node, f"ending-node-{node}") for node in range(4)]
    try:

        async def trained_to_the_end() -> dict[str, Any] | None:
            for agent in agents:  # the operator reads the stream from its end: repeat until it is read
                await agent.record_iteration(0, STEPS, 0.05, 4, loss=1.0)
            return await status_where(lambda s: s.get("step") == STEPS)

        await eventually(trained_to_the_end, 15, f"status.step {STEPS}")
    finally:
        await client.aclose()
    # Node 1 dies writing its layers; nodes 2 and 3 already wrote theirs and wait for the model to be whole.
    await set_pod_phase(kube, "ending-node-1", "Failed")
    await set_pod_phase(kube, "ending-node-3", "Succeeded")
    await set_pod_phase(kube, "ending-node-2", "Succeeded")
    planned = await eventually(
        lambda: status_where(lambda s: s.get("planGeneration") == 1), 15, "the plan around node 1"
    )
    assert planned["phase"] != "Succeeded", planned
    plan = json.loads((await kube.get("configmaps", "ending-plan"))["data"]["plan.json"])  # type: ignore[index]
    nodes = {s["node"] for p in plan["plan"]["pipelines"] for s in p["stages"] if not s["rerouted_to"]}
    assert 1 not in nodes and nodes <= {0, 2, 3}, plan["plan"]
    await asyncio.sleep(1.0)  # a pass or two: still not Succeeded, and no replacement asked for
    assert (await kube.job_status("ending"))["phase"] != "Succeeded"
    pods = {pod["metadata"]["name"] for pod in await kube.job_pods("ending")}
    assert pods <= {f"ending-node-{n}" for n in range(4)}, pods
    # Node 0 wrote the lost node's layers (it holds their replica) and completes: the job has succeeded.
    await set_pod_phase(kube, "ending-node-0", "Succeeded")
    done = await eventually(lambda: status_where(lambda s: s.get("phase") == "Succeeded"), 15, "Succeeded")
    assert done["step"] == STEPS
