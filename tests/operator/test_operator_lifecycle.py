"""The operator end to end against an API server (the emulator, or the cluster of RJOB_KUBECONFIG) and a real
Redis: creation, fail-stop, restart."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from _rjob_stack import Stack, eventually, heartbeats, job_manifest, redis_client

from resilientjob.operator.api import PLURAL
from resilientjob.planner.profile import uniform_profile

# serial: a failure is detected within 2 s
pytestmark = [pytest.mark.serial, pytest.mark.cluster]


async def test_create_job_makes_pods_service_configmap_and_status(stack: Stack) -> None:
    kube = stack.kube
    await kube.create_job(job_manifest("demo"))

    async def running() -> dict[str, Any] | None:
        body = await kube.get(PLURAL, "demo")
        status = (body or {}).get("status") or {}
        return status if status.get("planGeneration") == 0 and status.get("phase") == "Running" else None

    status = await eventually(running, 20, "status with generation 0")
    pods = await kube.job_pods("demo")
    assert sorted(p["metadata"]["name"] for p in pods) == [f"demo-node-{n}" for n in range(4)]
    job = await kube.get(PLURAL, "demo")
    assert job is not None
    for pod in pods:
        meta = pod["metadata"]
        assert meta["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        assert meta["annotations"]["resilientjob.io/generation"] == "0"
        assert meta["annotations"]["resilientjob.io/layout"] == status["layout"]
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["RJOB_NODE"]["value"] == meta["labels"]["resilientjob.io/node"]
    service = await kube.get("services", "demo-workers")
    assert service is not None and service["spec"]["clusterIP"] == "None"
    configmap = await kube.get("configmaps", "demo-plan")
    assert configmap is not None and configmap["data"]["generation"] == "0"
    plan = json.loads(configmap["data"]["plan.json"])
    assert plan["layout"] == status["layout"]
    assert sum(p["microbatches"] for p in plan["plan"]["pipelines"]) == 16
    assert status["workersTotal"] == 4 and status["layout"].startswith("DP")
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Valid"] == "SpecValid"


async def test_deleted_pod_gives_new_generation_within_2s(stack: Stack) -> None:
    kube = stack.kube
    await kube.create_job(job_manifest("kill"))

    async def generation(g: int) -> dict[str, Any] | None:
        status = await kube.job_status("kill")
        return status if status.get("planGeneration") == g else None

    await eventually(lambda: generation(0), 20, "generation 0")
    started = time.monotonic()
    await kube.delete("pods", "kill-node-2")
    status = await eventually(lambda: generation(1), 2.0, "generation 1 after a pod deletion")
    elapsed = time.monotonic() - started
    assert elapsed < 2.0
    assert status["failedNodes"] == [2]
    decision = status["lastDecision"]
    assert decision["trigger"] == "NodeFailed" and decision["nodes"] == [2]
    # The real plan search: every policy was scored and the best feasible one was chosen.
    candidates = decision["candidates"]
    # `auto` weighs Odyssey's two recoveries and the checkpoint restart (templates only when named).
    assert {"reroute", "dynamic", "checkpoint"} <= {c["policy"] for c in candidates}
    best = max((c for c in candidates if c["feasible"]), key=lambda c: c["score"])
    assert decision["policy"] == best["policy"] == status["policy"] and decision["layout"] == best["layout"]
    assert all(c["score"] > 0 and c["stepTimeS"] > 0 for c in candidates if c["feasible"])
    recovery = status["recoveries"][-1]
    assert recovery["generation"] == 1 and 0 <= recovery["detectS"] < 2.0
    plan_nodes = {
        s["node"]
        for p in json.loads(
            (await kube.get("configmaps", "kill-plan"))["data"]["plan.json"]  # type: ignore[index]
        )["plan"]["pipelines"]
        for s in p["stages"]
        if not s["rerouted_to"]
    }
    assert 2 not in plan_nodes
    for pod in await kube.job_pods("kill"):
        assert pod["metadata"]["annotations"]["resilientjob.io/generation"] == "1"


async def test_expired_heartbeat_is_detected_within_3s(stack: Stack) -> None:
    import redis.asyncio as aioredis

    kube = stack.kube
    await kube.create_job(job_manifest("hb"))

    async def generation(g: int) -> dict[str, Any] | None:
        status = await kube.job_status("hb")
        return status if status.get("planGeneration") == g else None

    await eventually(lambda: generation(0), 20, "generation 0")
    client = aioredis.Redis.from_url(stack.redis_url)
    try:
        # Four agents beating every 0.5 s with the agents' TTL; node 1 stops.
        for _ in range(3):
            for node in range(4):
                await client.set(stack.keys("hb").heartbeat(node), b"{}", px=2000)
            await asyncio.sleep(0.5)
        stopped_at = time.monotonic()
        async with heartbeats(client, stack.keys("hb"), [0, 2, 3], every_s=0.5):
            status = await eventually(lambda: generation(1), 3.5, "generation 1 after node 1 stopped beating")
            detected = time.monotonic() - stopped_at
    finally:
        await client.aclose()
    assert detected < 3.0 + 0.5  # TTL 2 s after the last beat (<= 0.5 s before stopped_at) + poll
    assert status["failedNodes"] == [1]
    assert status["lastDecision"]["trigger"] == "HeartbeatExpired"
    # Measured from the last time the operator saw the key alive: about the TTL (2 s), never more than 3 s.
    assert 1.0 <= status["recoveries"][-1]["detectS"] <= 3.0
    # Fenced: the pod of the silent node is deleted so that it cannot rejoin with stale state.
    assert "hb-node-1" not in {p["metadata"]["name"] for p in await kube.job_pods("hb")}


async def test_sigkill_mid_reconfiguration_then_restart_gives_one_generation(stack: Stack) -> None:
    import redis.asyncio as aioredis

    kube, operator = stack.kube, stack.operator
    await kube.create_job(job_manifest("crash"))

    async def status_of() -> dict[str, Any]:
        return await kube.job_status("crash")

    async def generation(g: int) -> dict[str, Any] | None:
        status = await status_of()
        return status if status.get("planGeneration") == g else None

    await eventually(lambda: generation(0), 20, "generation 0")
    client = aioredis.Redis.from_url(stack.redis_url)
    try:
        # Kill the operator the moment generation 1 is committed in Redis, before it is fully applied.
        await kube.delete("pods", "crash-node-0")

        async def committed() -> int | None:
            raw = await client.get(stack.keys("crash").plan)
            generation = json.loads(raw)["generation"] if raw else 0
            return generation if generation >= 1 else None

        assert await eventually(committed, 3, "generation 1 committed") == 1
        operator.kill()
        operator.start()
        status = await eventually(lambda: generation(1), 20, "generation 1 applied after the restart")
        await asyncio.sleep(1.5)  # a restarted operator that re-decided would publish generation 2 by now
        status = await status_of()
        raw = await client.get(stack.keys("crash").plan)
    finally:
        await client.aclose()
    assert status["planGeneration"] == 1
    assert json.loads(raw)["generation"] == 1
    assert status["failedNodes"] == [0]
    assert [r["generation"] for r in status["recoveries"]] == [1]
    pods = await kube.job_pods("crash")
    # The three survivors and one replacement for node 0 under a fresh id (`_capacity`; an id may be skipped
    # when the kill fell between recording it and creating the pod, never reused or doubled).
    nodes = sorted(int(p["metadata"]["labels"]["resilientjob.io/node"]) for p in pods)
    assert nodes[:3] == [1, 2, 3] and len(nodes) == 4 and nodes[3] >= 4, nodes
    assert status["capacity"]["nextNodeId"] == nodes[3] + 1
    assert {p["metadata"]["annotations"]["resilientjob.io/generation"] for p in pods} == {"1"}


async def test_a_pod_that_outlived_its_fence_goes_when_the_operator_restarts(stack: Stack) -> None:
    """The fence is written to the status before the pod is deleted; an operator stopped between the two
    left the pod running. The restarted operator deletes it and plans around the node, never back in."""
    kube, operator = stack.kube, stack.operator
    await kube.create_job(job_manifest("outlived"))

    async def generation(g: int) -> dict[str, Any] | None:
        status = await kube.job_status("outlived")
        return status if status.get("planGeneration") == g else None

    await eventually(lambda: generation(0), 20, "generation 0")
    operator.kill()
    await kube.api.patch(kube.path(PLURAL, "outlived", status=True), {"status": {"fencedNodes": [2]}})
    assert await kube.get("pods", "outlived-node-2") is not None
    operator.start()

    async def gone() -> bool | None:
        return True if await kube.get("pods", "outlived-node-2") is None else None

    await eventually(gone, 20, "the fenced node's pod deleted")
    status = await eventually(lambda: generation(1), 20, "generation 1 without node 2")
    assert status["recoveries"][-1]["nodes"] == [2]
    await asyncio.sleep(1.5)  # a pod left running would have joined by now
    status = await kube.job_status("outlived")
    assert status["planGeneration"] == 1
    nodes = {int(p["metadata"]["labels"]["resilientjob.io/node"]) for p in await kube.job_pods("outlived")}
    assert 2 not in nodes


async def test_a_restarted_operator_leaves_ended_jobs_ended(stack: Stack) -> None:
    """An operator that restarts (an upgrade, a failover) finds jobs that ended: nothing of them runs again.
    A failed job's pods go if its failure was cut short before they did; a succeeded one's stay for their
    logs. Before, the restart ran a failed job's generation (or pre-flight) again."""
    kube, operator = stack.kube, stack.operator
    # The succeeded job's profile ConfigMap is cleaned up after it ended: its spec is not read again (it was,
    # and the job turned Failed on the missing ConfigMap).
    profile = json.dumps(uniform_profile(8).model_dump(mode="json"))
    await kube.api.create(
        kube.path("configmaps"), {"metadata": {"name": "ok-profile"}, "data": {"profile.json": profile}}
    )
    await kube.create_job(job_manifest("ended-ok", profile={"configMapRef": {"name": "ok-profile"}}))
    await kube.create_job(job_manifest("ended-bad"))
    for name in ("ended-ok", "ended-bad"):

        async def planned(name: str = name) -> dict[str, Any] | None:
            status = await kube.job_status(name)
            return status if status.get("planGeneration") == 0 else None

        await eventually(planned, 20, f"{name} generation 0")
    operator.kill()
    assert await kube.delete("configmaps", "ok-profile")
    await kube.api.patch(kube.path(PLURAL, "ended-ok", status=True), {"status": {"phase": "Succeeded"}})
    failed = {
        "type": "Planned",
        "status": "False",
        "reason": "PlanInfeasible",
        "message": "failed: no node survives; the job cannot continue",
    }
    await kube.api.patch(
        kube.path(PLURAL, "ended-bad", status=True), {"status": {"phase": "Failed", "conditions": [failed]}}
    )
    assert len(await kube.job_pods("ended-bad")) == 4
    operator.start()

    async def bad_pods_gone() -> bool | None:
        return True if not await kube.job_pods("ended-bad") else None

    await eventually(bad_pods_gone, 20, "the failed job's pods deleted")
    await asyncio.sleep(1.0)
    for name, phase in (("ended-ok", "Succeeded"), ("ended-bad", "Failed")):
        status = await kube.job_status(name)
        assert status["phase"] == phase and status["planGeneration"] == 0, status
    assert len(await kube.job_pods("ended-ok")) == 4


async def test_status_shows_the_committed_step_and_its_loss(stack: Stack) -> None:
    """The agents' real telemetry code reports committed steps with their loss; the status follows the newest
    (generation first: a restart from a checkpoint goes back to the restored step) and never goes back for a
    late report of an older generation."""
    from resilientjob.agent.telemetry import Telemetry

    kube = stack.kube
    await kube.create_job(job_manifest("progress", failSlow={"enabled": False}))

    async def status_where(check: Any) -> dict[str, Any] | None:
        status = await kube.job_status("progress")
        return status if check(status) else None

    await eventually(lambda: status_where(lambda s: s.get("planGeneration") == 0), 20, "generation 0")
    client = await redis_client(stack.redis_url)
    agents = [Telemetry(client, stack.keys("progress"), node, f"progress-node-{node}") for node in range(4)]
    try:
        for step in range(1, 6):
            for agent in agents:
                await agent.record_iteration(0, step, 0.05, 4, loss=4.0 - step / 2)

        async def step_5() -> dict[str, Any] | None:
            # The operator's first read of the stream starts at its end: steps written before that first
            # pass (the status shows generation 0 before it) are not read. Step 5 again, as agents repeat.
            for agent in agents:
                await agent.record_iteration(0, 5, 0.05, 4, loss=1.5)
            return await status_where(lambda s: s.get("step") == 5)

        status = await eventually(step_5, 10, "status.step 5 from the iterations")
        assert status["loss"] == pytest.approx(1.5)
        # Generation 1 restored step 3 from a checkpoint: the counter follows it back.
        await agents[0].record_iteration(1, 3, 0.05, 4, loss=2.25)
        status = await eventually(lambda: status_where(lambda s: s.get("step") == 3), 10, "the restored step")
        assert status["loss"] == pytest.approx(2.25)
        # A straggler of generation 0 reporting later changes nothing; generation 1 goes on.
        await agents[1].record_iteration(0, 6, 0.05, 4, loss=9.0)
        await agents[0].record_iteration(1, 4, 0.05, 4, loss=2.0)
        status = await eventually(lambda: status_where(lambda s: s.get("step") == 4), 10, "step 4")
        assert status["loss"] == pytest.approx(2.0)
    finally:
        await client.aclose()
    row = await kube.get(PLURAL, "progress")
    assert row is not None and row["status"]["step"] == 4
