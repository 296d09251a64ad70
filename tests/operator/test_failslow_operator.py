"""Fail-slow localisation end to end (real operator process, an API server over HTTP, real Redis): a
communication slowdown reported by the agents' real telemetry code is validated (the test answers the
ValidationRequest as the workers' rank 0 would, in the real Redis), the slow link is named in status and an
Event and moved off the data-parallel path by S3 (a); and an operator SIGKILLed mid-episode continues it at
the same rung."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from _rjob_stack import Stack, eventually, job_manifest

from resilientjob.agent.telemetry import Telemetry
from resilientjob.planner.plan import Plan
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import ValidationRequest, ValidationResult, encode

pytestmark = pytest.mark.cluster

GiB = 2**30
# 8 layers of 12 GiB of state: one 80 GiB device holds half the model, so 4 nodes run DP2 PP[2,2].
BIG_LAYER = {
    "forwardS": 0.01,
    "backwardS": 0.02,
    "paramBytes": 4 * GiB,
    "optimizerBytes": 8 * GiB,
    "activationBytes": 2**20,
}


async def _generation(kube: Any, name: str, generation: int, timeout: float) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        status = await kube.job_status(name)
        return status if status.get("planGeneration", -1) >= generation else None

    return await eventually(reached, timeout, f"{name} generation {generation}")


Step = Callable[[int], tuple[float, float | None]]


async def _agents(
    client: aioredis.Redis, keys: JobKeys, nodes: int, step_time: Callable[[int], Step], stop: asyncio.Event
) -> None:
    """The workers' telemetry (the agents' real code) at faster than real time; `step_time(node)(step)` is
    (seconds, compute_s)."""
    agents = [Telemetry(client, keys, node, f"pod-{node}") for node in range(nodes)]
    step = 0
    while not stop.is_set():
        step += 1
        generation = json.loads(await client.get(keys.plan))["generation"]
        for agent in agents:
            seconds, compute = step_time(agent.node)(step)
            await agent.record_iteration(generation, step, seconds, 4, compute_s=compute)
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _running(task: Awaitable[None], stop: asyncio.Event) -> Any:
    runner = asyncio.ensure_future(task)
    try:
        yield runner
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await runner


async def test_a_slow_link_is_validated_named_and_moved_off_the_data_parallel_path(stack: Stack) -> None:
    kube = stack.kube
    overheads = {"microbatchS": 0.1, "topologyS": 0.4, "restartS": 100.0}
    manifest = job_manifest(
        "vlink", profile={"inline": [BIG_LAYER] * 8}, failSlow={"minDurationS": 0, "overheads": overheads}
    )
    await kube.create_job(manifest)
    status = await _generation(kube, "vlink", 0, 20)
    assert status["layout"] == "DP2 PP[2,2]"
    client = aioredis.Redis.from_url(stack.redis_url)
    keys = stack.keys("vlink")
    plan = json.loads(await client.get(keys.plan))["plan"]
    first_stage = [p["stages"][0]["node"] for p in plan["pipelines"]]
    link = (first_stage[0], first_stage[1])  # the all-reduce of stage 0 runs over it
    rng = random.Random(5)
    slow = {"on": False}

    def step_time(node: int) -> Step:
        def one(step: int) -> tuple[float, float | None]:
            compute = 0.08 * (1 + 0.01 * rng.gauss(0, 1))
            # A slow link: every worker waits at the all-reduce; nobody's compute moves.
            communication = 0.02 * (1 + 0.01 * rng.gauss(0, 1)) + (0.1 if slow["on"] else 0.0)
            return compute + communication, compute

        return one

    stop = asyncio.Event()
    try:
        async with _running(_agents(client, keys, 4, step_time, stop), stop):
            await asyncio.sleep(0.8)
            slow["on"] = True

            async def requested() -> ValidationRequest | None:
                raw = await client.get(keys.validation_request)
                return ValidationRequest.model_validate_json(raw) if raw else None

            request = await eventually(requested, 10, "a validation request")
            assert request.generation == 0 and request.id >= 1 and set(request.suspects) & set(range(4))
            result = ValidationResult(
                id=request.id,
                generation=request.generation,
                step=100,
                gemm_s=dict.fromkeys(range(4), 0.01),
                slow_links=[link],
                held_s=0.6,
                finished_at=0.0,
            )
            await client.xadd(keys.validation_results, {"m": encode(result)})
            status = await _generation(kube, "vlink", 1, 15)
            moved = json.loads(await client.get(keys.plan))
    finally:
        await client.aclose()
    assert status["slowLinks"] == [f"{link[0]}->{link[1]}"] and sorted(status["slowNodes"]) == sorted(link)
    decision = status["lastDecision"]
    assert decision["strategy"] == "topology" and decision["trigger"] == "NodeSlow"
    # S2 does not help a slow link (Falcon Table 3): S3 (a) was the first rung.
    assert [r["strategy"] for r in status["recoveries"]] == ["topology"]
    stage_of = {s["node"]: i for p in moved["plan"]["pipelines"] for i, s in enumerate(p["stages"])}
    assert stage_of[link[0]] != stage_of[link[1]]  # now a pipeline hop (or no traffic), not the all-reduce
    assert moved["plan"]["transfers"] and moved["restore"] is not None

    async def events() -> list[str] | None:
        reasons = [e.get("reason") for e in await kube.events_of("vlink")]
        wanted = {"ValidationRequested", "SlowLinkFound", "NodeSlow"}
        return reasons if wanted <= set(reasons) else None

    await eventually(events, 5, "validation and slow-link events")


async def test_an_operator_killed_mid_episode_continues_at_the_same_rung(stack: Stack) -> None:
    kube = stack.kube
    # The agents step faster than real time (~50 steps/s of 0.1 s excess each, node 1 2x slow): S4's price
    # is high enough that the kill below comes between S2 and S4. (Not 8x: S2 would drain node 1's replica,
    # which no later rung can better, and the episode would stop there.)
    overheads = {"microbatchS": 0.3, "topologyS": 1.0, "restartS": 40.0}
    await kube.create_job(job_manifest("resume", failSlow={"minDurationS": 0, "overheads": overheads}))
    await _generation(kube, "resume", 0, 20)
    client = aioredis.Redis.from_url(stack.redis_url)
    keys = stack.keys("resume")
    rng = random.Random(3)
    factor = {"value": 1.0}

    def step_time(node: int) -> Step:
        def one(step: int) -> tuple[float, float | None]:
            slow = factor["value"] if node == 1 else 1.0
            return 0.1 * slow * (1 + 0.01 * rng.gauss(0, 1)), None

        return one

    stop = asyncio.Event()
    try:
        async with _running(_agents(client, keys, 4, step_time, stop), stop):
            await asyncio.sleep(0.8)
            factor["value"] = 2.0
            status = await _generation(kube, "resume", 1, 15)
            assert status["lastDecision"]["strategy"] == "microbatch"

            async def stored() -> dict[str, Any] | None:
                raw = await client.get(f"{keys.prefix}failslow")
                state = json.loads(raw)["state"] if raw else {}
                episode = state.get("episode") or {}
                applied = episode.get("applied") or []
                return state if applied[:1] == ["microbatch"] and "replace" not in applied else None

            before = await eventually(stored, 5, "the episode stored after S2")
            stack.operator.kill()
            await asyncio.sleep(0.3)  # the agents go on meanwhile
            stack.operator.start()

            async def parked() -> dict[str, Any] | None:
                status = await kube.job_status("resume")
                return status if status.get("parkedNodes") == [1] else None

            status = await eventually(parked, 25, "S4 after the restart")
            after = json.loads(await client.get(f"{keys.prefix}failslow"))["state"]
    finally:
        await client.aclose()
    # The restarted operator went on from S2 to the next useful rung (S3 cannot help a one-stage layout):
    # no second S2, no second NodeSlow, and the loss went on from where it was.
    assert [r["strategy"] for r in status["recoveries"]] == ["microbatch", "replace"]
    assert after["episode"]["applied"] == ["microbatch", "topology", "replace"]
    assert after["episode"]["loss_s"] >= before["episode"]["loss_s"] >= 0.3
    events = await kube.events_of("resume")
    messages = [e.get("message", "") for e in events]
    assert sum(1 for e in events if e.get("reason") == "NodeSlow" and "slower" in e.get("message", "")) == 1
    assert not any("microbatch not applied" in m for m in messages)


async def test_a_drained_node_whose_recovery_report_never_comes_is_timed_again_and_taken_back(
    stack: Stack,
) -> None:
    """S2 drains node 1 (x8: none of its micro-batches are worth keeping); its probe never reports a recovery
    (it recovered before the probe had a first level, or Redis lost the report). The operator times its
    device with a validation pass `drainedRecheckS` after the drain, again twice as late while the pass
    finds it slow, and restores the healthy plan once a pass finds it healthy."""
    kube = stack.kube
    overheads = {"microbatchS": 0.1, "topologyS": 100.0, "restartS": 100.0}
    failslow = {"minDurationS": 0, "drainedRecheckS": 2, "overheads": overheads}
    await kube.create_job(job_manifest("recheck", failSlow=failslow))
    await _generation(kube, "recheck", 0, 20)
    client = aioredis.Redis.from_url(stack.redis_url)
    keys = stack.keys("recheck")
    agents = [Telemetry(client, keys, node, f"pod-{node}") for node in range(4)]
    rng = random.Random(9)
    slowed = {"on": False}
    seen: dict[int, float] = {}  # generation -> when the agents first saw it (its commit)
    stop = asyncio.Event()

    async def steps() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            announced = json.loads(await client.get(keys.plan))
            generation, drained = announced["generation"], Plan.model_validate(announced["plan"]).idle_nodes
            seen.setdefault(generation, asyncio.get_running_loop().time())
            for agent in agents:
                jitter = 1 + 0.01 * rng.gauss(0, 1)
                if agent.node in drained:  # a flat probe: its level never falls, no recovery is reported
                    await agent.record_iteration(
                        generation, step, 0.1 * jitter, 0, "drained", compute_s=0.004 * jitter
                    )
                    continue
                compute = 0.08 * (8 if slowed["on"] and agent.node == 1 else 1) * jitter
                await agent.record_iteration(generation, step, compute + 0.02, 4, compute_s=compute)
            await asyncio.sleep(0.01)

    async def request_after(last: int) -> ValidationRequest | None:
        raw = await client.get(keys.validation_request)
        request = ValidationRequest.model_validate_json(raw) if raw else None
        return request if request is not None and request.id > last else None

    async def answer(request: ValidationRequest, node_1_s: float) -> None:
        gemm = {0: 0.010, 1: node_1_s, 2: 0.0101, 3: 0.0099}
        result = ValidationResult(
            id=request.id, generation=request.generation, step=500, gemm_s=gemm, held_s=0.2, finished_at=0.0
        )
        await client.xadd(keys.validation_results, {"m": encode(result)})

    try:
        async with _running(steps(), stop):
            await asyncio.sleep(0.8)
            slowed["on"] = True
            status = await _generation(kube, "recheck", 1, 15)
            assert status["lastDecision"]["strategy"] == "microbatch", status["lastDecision"]
            slow = await eventually(lambda: request_after(0), 10, "the drained node's first recheck")
            first_at = asyncio.get_running_loop().time()
            first_after = first_at - seen[1]
            assert slow.suspects == [1] and slow.generation == 1, slow
            await answer(slow, 0.08)  # still 8x
            healthy = await eventually(lambda: request_after(slow.id), 15, "its second recheck")
            second_after = asyncio.get_running_loop().time() - first_at
            assert healthy.suspects == [1], healthy
            slowed["on"] = False  # the restored plan must not meet the slowdown again
            await answer(healthy, 0.0102)
            status = await _generation(kube, "recheck", 2, 15)
    finally:
        await client.aclose()
    # The first pass `drainedRecheckS` after the drain, the next twice that after it.
    assert 1.5 <= first_after <= 6 and 3 <= second_after <= 9, (first_after, second_after)
    assert status["lastDecision"]["strategy"] == "restore" and not status.get("slowNodes"), status
    assert [r["strategy"] for r in status["recoveries"]] == ["microbatch", "restore"]

    async def events() -> list[str] | None:
        messages = [e.get("message", "") for e in await kube.events_of("recheck")]
        still = any("drained with no recovery report" in m and "8.00x the median" in m for m in messages)
        back = any(m.startswith("node 1 is back: validation at step 500") and "1.02x" in m for m in messages)
        return messages if still and back else None

    await eventually(events, 5, "the rechecks' events")
