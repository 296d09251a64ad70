"""A worker lost after the last step, while the trained model is written out, through the real operator
(emulated API server, real Redis; the test plays the kubelet and the agents' telemetry): the job is not
Succeeded while a pod of its plan has failed. The operator plans around the lost node, as at any failure,
and the plan it publishes (which the survivors read to write the lost node's layers: `agent._final_export`)
leaves the node out, and asks for no replacement. Once the survivors' pods complete, the job has succeeded."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from _rjob_stack import Stack, emulator_only, eventually, job_manifest, redis_client, set_pod_phase

from resilientjob.protocol.messages import ModelProfileReport, ModelProfileRequest

pytestmark = [
    pytest.mark.cluster,
    emulator_only("the test sets pod phases itself, as the kubelet of a real cluster would"),
]

STEPS = 40


StatusWhere = Callable[[Callable[[dict[str, Any]], bool]], Awaitable[dict[str, Any] | None]]


async def _at_the_last_step(stack: Stack, job: str, **spec: Any) -> StatusWhere:
    """Run `job` (4 nodes) to its last step as its pods and agents would: node 0's pre-flight answered, the
    pods Running, every agent's telemetry at step STEPS; a reader of its status that answers once a check
    holds."""
    from resilientjob.agent.telemetry import Telemetry

    kube = stack.kube
    await kube.create_job(job_manifest(job, training={"steps": STEPS}, failSlow={"enabled": False}, **spec))

    async def status_where(check: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        status = await kube.job_status(job)
        return status if status and check(status) else None

    client = await redis_client(stack.redis_url)
    keys = stack.keys(job)
    try:
        # Node 0's pre-flight, as its agent answers it: the model built, with the profile's 8 layers.
        raw = await eventually(lambda: client.get(keys.profile_request), 20, "node 0's pre-flight request")
        request = ModelProfileRequest.model_validate_json(raw)
        report = ModelProfileReport(request=request, node=0, num_layers=8, sent_at=time.time())
        await client.set(keys.profile_report, report.model_dump_json())
        await eventually(lambda: status_where(lambda s: s.get("planGeneration") == 0), 20, "generation 0")
        for node in range(4):
            await set_pod_phase(kube, f"{job}-node-{node}", "Running")
        agents = [Telemetry(client, keys, node, f"{job}-node-{node}") for node in range(4)]

        async def trained_to_the_end() -> dict[str, Any] | None:
            for agent in agents:  # the operator reads the stream from its end: repeat until it is read
                await agent.record_iteration(0, STEPS, 0.05, 4, loss=1.0)
            return await status_where(lambda s: s.get("step") == STEPS)

        await eventually(trained_to_the_end, 15, f"status.step {STEPS}")
    finally:
        await client.aclose()
    return status_where


async def test_a_worker_lost_while_the_model_is_written_is_planned_around(stack: Stack) -> None:
    kube = stack.kube
    # Not a simulation: the job ends at training.steps.
    status_where = await _at_the_last_step(stack, "ending", model="mypkg.model:build")
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


async def test_every_worker_lost_after_the_last_step_fails_the_job_saying_where_the_model_is(
    stack: Stack,
) -> None:
    """No replacement is asked for (training is done) and nobody is left to write the model: the job fails
    at once, naming the checkpoint `rjob export` writes it from; before, the planner found no node to plan
    on and the job failed PlanInfeasible."""
    status_where = await _at_the_last_step(
        stack,
        "alllost",
        model="hf:/models/mine",
        output={"path": "/out"},
        checkpoint={"path": "/ckpt", "volume": "shared"},
    )
    # Seen by an operator restarted meanwhile: it reads only the telemetry that comes after its start, and
    # none will. It took the job for one still training: it waited for replacements, and restarted the job.
    stack.operator.kill()
    for node in range(4):
        await set_pod_phase(stack.kube, f"alllost-node-{node}", "Failed")
    stack.operator.start()
    failed = await eventually(lambda: status_where(lambda s: s.get("phase") == "Failed"), 20, "Failed")
    planned = next(c for c in failed["conditions"] if c["type"] == "Planned")
    assert planned["reason"] == "LostAfterTraining", failed["conditions"]
    assert planned["message"].startswith(f"spec.output.path: every node failed after the last step ({STEPS})")
    assert "`rjob export /ckpt --model hf:/models/mine --out DIR`" in planned["message"]
    assert failed.get("planGeneration") == 0  # nothing was planned on nobody
    pods = {pod["metadata"]["name"] for pod in await stack.kube.job_pods("alllost")}
    assert not pods - {f"alllost-node-{n}" for n in range(4)}, pods  # no replacement was asked for
