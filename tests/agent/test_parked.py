"""A node parked by fail-slow mitigation S4 goes on measuring its device (`agent._parked`), against a real
redis-server: its probe steps carry no samples and the chaos order's stretch, its detector reports the
recovery when the order ends, and the probe stops when a generation takes the node back."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from _support import redis_server

from resilientjob.agent import _parked
from resilientjob.agent._redis import connect
from resilientjob.agent.telemetry import Telemetry
from resilientjob.operator._redis_state import JobRedis, announcement
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.chaos import ChaosOrder
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import IterationRecord, SlowReport

SLOWED_S = _parked.SETTLE_S + 5.0


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    redis = connect(redis_url)
    await redis.flushall()
    yield redis
    await redis.aclose()


def _plan(nodes: list[int], generation: int) -> Plan:
    """Whole-model replicas on `nodes`."""
    return Plan(
        policy=Policy.DYNAMIC,
        generation=generation,
        microbatch_size=1,
        pipelines=tuple(
            PipelinePlan(stages=(StagePlan(layers=(0, 4), node=node),), microbatches=2) for node in nodes
        ),
        step_time_s=0.1,
    )


async def test_a_parked_node_reports_its_recovery_and_stops_probing_when_taken_back(
    client: aioredis.Redis,
) -> None:
    keys = JobKeys("ns", "parked")
    operator_side = JobRedis(client, keys)
    await operator_side.announce(announcement(_plan([0], 1), "NodeSlow", [1], parked=[1]))
    order = ChaosOrder(factor=4.0, until=time.time() + SLOWED_S)
    await client.set(keys.chaos(1), order.model_dump_json(exclude_none=True))
    telemetry = Telemetry(client, keys, node=1, pod="p-1")
    await operator_side.new_iterations()  # the operator's cursors start here
    await operator_side.new_reports()
    stopped = asyncio.Event()
    began = time.monotonic()
    probing = asyncio.create_task(_parked.until_taken_back(telemetry, stopped, ["cpu"], step=100))

    steps: list[IterationRecord] = []
    reports: list[SlowReport] = []
    deadline = time.monotonic() + SLOWED_S + 30
    # The report the operator acts on undoes half the x4 (`_undoes_its_slowdown`); a smaller fall read on
    # a loaded host is one it dismisses, and none comes while the order holds.
    undone = 1 / math.sqrt(order.factor)
    while not any(r.recovered and r.slowdown <= undone for r in reports) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        steps += await operator_side.new_iterations()
        reports += await operator_side.new_reports()
    recovered = [r for r in reports if r.recovered and r.slowdown <= undone]
    assert recovered and recovered[0].node == 1, reports
    print(f"recovery reported {time.monotonic() - began:.1f} s after parking, {len(steps)} probe steps")
    assert not probing.done()

    assert [s.step for s in steps] == list(range(101, 101 + len(steps)))  # counting on from the last step
    assert all(s.node == 1 and s.samples == 0 and s.generation == 1 for s in steps)
    slowed = [s for s in steps if s.chaos_s]
    healthy = [s for s in steps if not s.chaos_s]
    assert slowed and healthy
    # The order stretched the probe itself: x4 is three times the product's own time added.
    assert all(s.chaos_s == pytest.approx(3 * (s.seconds - (s.chaos_s or 0)), rel=1e-6) for s in slowed)

    await operator_side.announce(announcement(_plan([0, 1], 2), "NodeRecovered", [1]))
    back = await asyncio.wait_for(probing, 5)
    assert back is not None and back.generation == 2 and 1 in back.plan.nodes


async def test_a_stopped_pod_stops_probing(client: aioredis.Redis) -> None:
    keys = JobKeys("ns", "parked-stop")
    await JobRedis(client, keys).announce(announcement(_plan([0], 3), parked=[1]))
    stopped = asyncio.Event()
    probing = asyncio.create_task(
        _parked.until_taken_back(Telemetry(client, keys, node=1, pod="p-1"), stopped, ["cpu"], step=0)
    )
    await asyncio.sleep(0.5)
    stopped.set()
    assert await asyncio.wait_for(probing, 5) is None


async def test_only_a_live_compute_order_stretches_the_probe(client: aioredis.Redis) -> None:
    keys = JobKeys("ns", "parked-orders")
    telemetry = Telemetry(client, keys, node=1, pod="p-1")
    assert await _parked.compute_factor(telemetry) == 1.0
    link = ChaosOrder(factor=5.0, until=time.time() + 60, link=0)
    await client.set(keys.chaos(1), link.model_dump_json(exclude_none=True))
    assert await _parked.compute_factor(telemetry) == 1.0  # a slow link slows no compute
    expired = ChaosOrder(factor=5.0, until=time.time() - 1)
    await client.set(keys.chaos(1), expired.model_dump_json(exclude_none=True))
    assert await _parked.compute_factor(telemetry) == 1.0
    await client.set(keys.chaos(1), ChaosOrder(factor=2.5, until=time.time() + 60).model_dump_json())
    assert await _parked.compute_factor(telemetry) == 2.5
    await client.set(keys.chaos(1), b"not an order")
    assert await _parked.compute_factor(telemetry) == 1.0


@pytest.mark.torch
def test_an_accelerator_probe_is_a_product_wide_enough_to_be_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator a CPU-sized product is a kernel launch, which a throttled clock barely moves: the
    probe there is `ACCELERATOR_PROBE_SIZE` wide, whatever CPU size its caller (a drained worker) asks."""
    import torch

    from resilientjob.agent import validation, worker
    from resilientjob.agent.validation import GemmResult

    asked: list[tuple[int, str]] = []

    def timed(size: int, repeats: int, device: str, **_: object) -> GemmResult:
        asked.append((size, device))
        return GemmResult(rank=0, seconds=1e-3, flops_per_s=2 * size**3 / 1e-3)

    monkeypatch.setattr(validation, "gemm_benchmark", timed)
    monkeypatch.setattr(worker, "worker_device", lambda kind, index: None)  # no device to make current here
    assert _parked.measure("cuda:1", 384, 3) == 1e-3
    threads = torch.get_num_threads()
    try:
        assert _parked.measure("cpu", 384, 3) == 1e-3
    finally:
        torch.set_num_threads(threads)  # the CPU probe runs on one thread; this test process goes on
    assert asked == [(_parked.ACCELERATOR_PROBE_SIZE, "cuda:1"), (384, "cpu")]
