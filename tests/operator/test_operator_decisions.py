"""The operator's decisions end to end (real operator process, an API server over HTTP, real Redis): the
checkpoint path when more than f failures took a stage everywhere, and the fail-slow ladder driven by the
agents' real telemetry code (BOCD reports and iteration times written to Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from typing import Any

import pytest
import redis.asyncio as aioredis
from _rjob_stack import Stack, eventually, heartbeats, job_manifest

from resilientjob.agent.telemetry import Telemetry

pytestmark = pytest.mark.cluster

GiB = 2**30


async def test_more_than_f_failures_losing_a_stage_take_the_checkpoint_path(stack: Stack) -> None:
    kube = stack.kube
    # 8 layers of 12 GiB of state: one 80 GiB device holds half the model, so the layout is DP2 PP[2,2].
    layer = {
        "forwardS": 0.01,
        "backwardS": 0.02,
        "paramBytes": 4 * GiB,
        "optimizerBytes": 8 * GiB,
        "activationBytes": 2**20,
    }
    await kube.create_job(job_manifest("ckpt", profile={"inline": [layer] * 8}))

    async def planned() -> dict[str, Any] | None:
        status = await kube.job_status("ckpt")
        return status if status.get("planGeneration") == 0 else None

    status = await eventually(planned, 20, "generation 0")
    assert status["layout"] == "DP2 PP[2,2]"
    client = aioredis.Redis.from_url(stack.redis_url)
    keys = stack.keys("ckpt")
    try:
        plan = json.loads(await client.get(keys.plan))["plan"]
        first_stage = sorted(p["stages"][0]["node"] for p in plan["pipelines"])
        for _ in range(2):
            for node in range(4):
                await client.set(keys.heartbeat(node), b"{}", px=2000)
            await asyncio.sleep(0.4)
        # Both replicas of stage 0 stop at once (f = 1): their layers survive nowhere.
        await client.delete(*(keys.heartbeat(node) for node in first_stage))
        survivors = [node for node in range(4) if node not in first_stage]

        async def replanned() -> dict[str, Any] | None:
            status = await kube.job_status("ckpt")
            return status if status.get("planGeneration") == 1 else None

        async with heartbeats(client, keys, survivors, every_s=0.4):
            status = await eventually(replanned, 5, "generation 1")
    finally:
        await client.aclose()
    decision = status["lastDecision"]
    assert status["failedNodes"] == first_stage and decision["nodes"] == first_stage
    assert decision["policy"] == status["policy"] == "checkpoint"
    by_policy = {c["policy"]: c for c in decision["candidates"]}
    assert {"reroute", "dynamic"} <= set(by_policy)  # templates are scored only when named
    for policy in set(by_policy) - {"checkpoint"}:
        assert not by_policy[policy]["feasible"] and "no surviving replica" in by_policy[policy]["reason"]
    assert by_policy["checkpoint"]["feasible"] and by_policy["checkpoint"]["score"] > 0
    assert by_policy["checkpoint"]["transitionS"] > 0


async def test_fail_slow_ladder_s2_then_s4_then_back_when_the_node_recovers(stack: Stack) -> None:
    kube = stack.kube
    overheads = {"microbatchS": 0.3, "topologyS": 1.0, "restartS": 2.5}
    manifest = job_manifest("slow", failSlow={"minDurationS": 0, "overheads": overheads})
    await kube.create_job(manifest)

    async def planned() -> dict[str, Any] | None:
        status = await kube.job_status("slow")
        return status if status.get("planGeneration") == 0 else None

    healthy = await eventually(planned, 20, "generation 0")
    assert healthy["layout"] == "DP4 PP[1,1,1,1]"
    client = aioredis.Redis.from_url(stack.redis_url)
    keys = stack.keys("slow")
    agents = [Telemetry(client, keys, node, f"slow-node-{node}") for node in range(4)]
    factor = {"value": 1.0}
    rng = random.Random(3)

    async def run_agents(stop: asyncio.Event) -> None:
        """Four workers at 0.1 s/step (1% jitter) reporting through the real telemetry; node 1 at x factor.
        Steps are reported faster than real time: only the reported durations matter to the controller."""
        step = 0
        while not stop.is_set():
            step += 1
            generation = json.loads(await client.get(keys.plan))["generation"]
            for agent in agents:
                slow = factor["value"] if agent.node == 1 else 1.0
                await agent.record_iteration(generation, step, 0.1 * slow * (1 + 0.01 * rng.gauss(0, 1)), 4)
            await asyncio.sleep(0.01)

    stop = asyncio.Event()
    driver = asyncio.create_task(run_agents(stop))
    try:
        await asyncio.sleep(0.8)
        factor["value"] = 3.0

        async def parked() -> dict[str, Any] | None:
            status = await kube.job_status("slow")
            return status if status.get("parkedNodes") == [1] else None

        status = await eventually(parked, 15, "S4 parks node 1")
        assert status["slowNodes"] == [1] and status["lastDecision"]["strategy"] == "replace"
        assert status["lastDecision"]["trigger"] == "NodeSlow" and status["failedNodes"] == []
        # Parked, node 1 keeps reporting (probe) steps; its detector needs a baseline before the recovery.
        await asyncio.sleep(1.0)
        factor["value"] = 1.0

        async def restored() -> dict[str, Any] | None:
            status = await kube.job_status("slow")
            decision = status.get("lastDecision") or {}
            return status if decision.get("strategy") == "restore" else None

        status = await eventually(restored, 15, "node 1 back after its recovery report")
        plan = json.loads(await client.get(keys.plan))
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await driver
        await client.aclose()
    strategies = [r["strategy"] for r in status["recoveries"]]
    # S2 first (cheapest); S3 cannot help one straggler in a one-stage layout; then S4; then back.
    assert strategies == ["microbatch", "replace", "restore"]
    s2 = status["recoveries"][0]
    assert s2["trigger"] == "NodeSlow" and s2["nodes"] == [1] and s2["detectS"] > 0
    # The steps from the onset to the episode's opening, as the operator dated them (the demo prints them).
    assert 0 <= s2["onsetStep"] <= s2["detectedStep"], s2
    assert all(r.get("detectedStep") is None for r in status["recoveries"] if r["strategy"] == "restore"), (
        status
    )
    assert status["parkedNodes"] == [] and status["slowNodes"] == [] and status["layout"] == "DP4 PP[1,1,1,1]"
    assert 1 in {s["node"] for p in plan["plan"]["pipelines"] for s in p["stages"] if not s["rerouted_to"]}
    assert plan["parked"] == [] and plan["restore"] is None and plan["trigger"] == "NodeRecovered"

    async def events() -> list[dict[str, Any]] | None:
        events = await kube.events_of("slow")
        reasons = [e.get("reason") for e in events]
        return events if "NodeRecovered" in reasons and "NodeSlow" in reasons else None

    await eventually(events, 5, "NodeSlow and NodeRecovered events")
