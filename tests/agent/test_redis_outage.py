"""Agents ride out a Redis blip (issue #14): a real redis-server is killed and a new, empty one started on
the same port about a second later. The synthetic training loop keeps stepping, the heartbeat comes back
(key and `beaten` bit rewritten into the empty Redis), the plan follower picks up the plan the operator
publishes again, the store host keeps serving and re-registers its address; nothing raises and each of
them logs the outage once, not once per retry."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest
from _support import RedisProcess

from resilientjob.agent import synthetic
from resilientjob.agent._redis import Outage, connect
from resilientjob.agent.store_host import StoreHost
from resilientjob.agent.telemetry import Telemetry
from resilientjob.operator._redis_state import JobRedis, announcement
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.keys import JobKeys

PASSWORD = "blip-password"


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    process = RedisProcess(PASSWORD)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def plan(generation: int) -> Plan:
    stages = (StagePlan(layers=(0, 2), node=0), StagePlan(layers=(2, 4), node=1))
    return Plan(
        policy=Policy.DYNAMIC,
        generation=generation,
        microbatch_size=1,
        pipelines=(PipelinePlan(stages=stages, microbatches=4),),
        step_time_s=0.4,
    )


async def wait_for(probe, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await probe()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_backoff_is_capped_jittered_and_logs_once_per_outage(capsys: pytest.CaptureFixture[str]) -> None:
    # The ceiling doubles to the cap; each wait is drawn between base/2 and it (a seeded draw keeps it exact).
    outage = Outage("unit", base_s=0.1, cap_s=1.0, jitter=random.Random(7))
    ceilings, waits = [], []
    for _ in range(12):
        waits.append(outage.failed(ConnectionError("refused")))
        ceilings.append(outage.ceiling())
    assert ceilings[:5] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0]) and set(ceilings[4:]) == {1.0}
    assert all(0.05 <= wait <= ceiling for wait, ceiling in zip(waits, ceilings, strict=True))
    assert len({round(wait, 6) for wait in waits[4:]}) == 8  # jittered: agents do not retry in step
    assert outage.down and outage.ok() and not outage.ok()
    # One failure between successes (a pooled connection the restart closed) is no outage.
    outage.failed(ConnectionError("Connection closed by server."))
    assert not outage.down and not outage.ok()
    outage.failed(TimeoutError("slow"))
    outage.failed(TimeoutError("slow"))
    outage.ok()
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if "Redis unreachable" in line]) == 2, lines
    assert len([line for line in lines if "Redis is back" in line]) == 2, lines
    assert outage.outages == 2
    with pytest.raises(ValueError, match="backoff"):
        Outage("bad", base_s=2.0, cap_s=1.0)


async def test_agent_and_store_host_ride_out_a_redis_restart_that_comes_back_empty(
    server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = JobKeys("ns", "blip")
    operator = connect(server.url, PASSWORD)
    agent_client = connect(server.url, PASSWORD)
    host_client = connect(server.url, PASSWORD)
    await JobRedis(operator, keys).announce(announcement(plan(0)))
    telemetry = Telemetry(agent_client, keys, node=0, pod="blip-node-0")
    host = StoreHost(host_client, keys, "127.0.0.1", poll_s=0.05)
    stopped = asyncio.Event()
    tasks = [
        asyncio.create_task(telemetry.heartbeat_forever(stopped)),
        asyncio.create_task(synthetic.train(telemetry, stopped, time_scale=0.1)),
        asyncio.create_task(host.run(stopped)),
    ]
    try:
        await wait_for(lambda: operator.xlen(keys.iterations), 10, "the first steps")
        await wait_for(lambda: operator.get(keys.store), 10, "the store host's address")

        server.kill()
        await asyncio.sleep(1.0)
        steps_during = telemetry.step
        await asyncio.sleep(0.5)
        assert telemetry.step > steps_during, "training stopped while Redis was away"
        server.start()  # the same port, empty
        await operator.aclose()  # the test's own client: its pooled connection died with the server
        operator = connect(server.url, PASSWORD)
        assert not await operator.exists(keys.plan)  # empty (the agent may have beaten already)

        await wait_for(lambda: operator.exists(keys.heartbeat(0)), 5, "the heartbeat in the new Redis")
        assert await operator.getbit(keys.beaten, 0) == 1
        # The operator publishes the plan again (from its durable state): the follower and the host get it.
        await JobRedis(operator, keys).announce(announcement(plan(1)))
        await wait_for(lambda: operator.get(keys.store), 5, "the store address re-registered")
        assert (await operator.get(keys.store)).decode() == host.address
        await wait_for(lambda: _at_generation(telemetry, 1), 10, "steps under the re-published plan")
        await wait_for(lambda: operator.xlen(keys.iterations), 5, "iteration records in the new Redis")
        assert host.plan is not None and host.plan.generation == 1
        assert host.store.get("generation") == b"1"
        assert not any(task.done() for task in tasks), [t.exception() for t in tasks if t.done()]
    finally:
        stopped.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        for client in (operator, agent_client, host_client):
            await client.aclose()
    assert not [r for r in results if isinstance(r, BaseException)], results
    out = capsys.readouterr().out
    assert "Traceback" not in out
    for who in ("agent node 0", "store host"):
        assert out.count(f"{who}: Redis unreachable") == 1, out
        assert out.count(f"{who}: Redis is back") == 1, out
    # What `kubectl logs` shows of the synthetic worker: its part in each generation, once.
    assert out.count("synthetic: node 0 generation 0") == 1, out
    assert out.count("synthetic: node 0 generation 1") == 1, out


async def _at_generation(telemetry: Telemetry, generation: int) -> bool:
    return telemetry.generation == generation
