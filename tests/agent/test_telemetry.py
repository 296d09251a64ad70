"""Agent telemetry against a real redis-server (with a password): heartbeats with a TTL, the capped
iteration stream, change-point reports, plan announcements, and hostile data dropped and counted."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from _support import redis_server
from redis.exceptions import AuthenticationError

from resilientjob.agent._redis import connect
from resilientjob.agent.telemetry import DRAINED_ROLE, PARKED_ROLE, Telemetry
from resilientjob.operator._redis_state import JobRedis, announcement
from resilientjob.planner.errors import PlannerError
from resilientjob.planner.failslow import DetectorConfig
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import (
    MAX_MESSAGE_BYTES,
    DropReason,
    IterationRecord,
    PlanAnnouncement,
    ProfileRecord,
    SlowKind,
    SlowReport,
    decode,
    dropped,
)

PASSWORD = "s3cret-for-tests"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server(PASSWORD) as url:
        yield url


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    redis = connect(redis_url, PASSWORD)
    await redis.flushall()
    yield redis
    await redis.aclose()


def two_node_plan(generation: int = 0) -> Plan:
    stages = (StagePlan(layers=(0, 2), node=0), StagePlan(layers=(2, 4), node=1))
    return Plan(
        policy=Policy.DYNAMIC,
        generation=generation,
        microbatch_size=1,
        pipelines=(PipelinePlan(stages=stages, microbatches=4),),
        step_time_s=0.1,
    )


async def test_wrong_password_is_refused(redis_url: str) -> None:
    redis = connect(redis_url, "wrong")
    with pytest.raises(AuthenticationError):
        await redis.ping()
    await redis.aclose()


async def test_heartbeat_key_expires_after_its_ttl(client: aioredis.Redis) -> None:
    keys = JobKeys("ns", "job")
    telemetry = Telemetry(
        client, keys, node=3, pod="job-node-3", heartbeat_interval_s=0.05, heartbeat_ttl_s=0.3
    )
    stopped = asyncio.Event()
    beating = asyncio.create_task(telemetry.heartbeat_forever(stopped))
    await asyncio.sleep(0.2)
    assert await client.exists(keys.heartbeat(3))
    assert 0 < await client.pttl(keys.heartbeat(3)) <= 300
    stopped.set()
    await beating
    await asyncio.sleep(0.4)
    assert not await client.exists(keys.heartbeat(3))


@pytest.mark.parametrize("finishes", [True, False])
async def test_an_agent_that_finished_training_leaves_a_long_last_heartbeat(
    client: aioredis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch, finishes: bool
) -> None:
    """The agent's exit protocol (the training is stood in for: the pod tests train for real): a pod whose
    training ended must not look dead to the operator while its process exits and the kubelet reports it
    Completed; one stopped by a signal (deleted) stops beating at once."""
    from resilientjob.agent import __main__ as agent_main
    from resilientjob.agent import _bridge

    async def train(telemetry: Telemetry, stopped: asyncio.Event, *_: object) -> int:
        await asyncio.sleep(0.3)  # beats meanwhile
        if not finishes:
            stopped.set()  # what SIGTERM does
        return 0

    monkeypatch.setattr(_bridge, "train", train)
    monkeypatch.setenv("RJOB_JOB", "fin")
    monkeypatch.setenv("RJOB_NODE", "1")
    monkeypatch.setenv("RJOB_REDIS_URL", redis_url)
    monkeypatch.setenv("RJOB_REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("RJOB_WORKLOAD", '{"model": "gpt"}')
    monkeypatch.delenv("RJOB_AGENT_METRICS_PORT", raising=False)
    assert await agent_main.main([]) == 0
    ttl_ms = await client.pttl(JobKeys("default", "fin").heartbeat(1))
    if finishes:
        assert ttl_ms > 2000 * 5, ttl_ms
    else:
        assert ttl_ms <= 2000, ttl_ms


async def test_iterations_go_to_a_capped_stream_and_the_operator_reads_them(client: aioredis.Redis) -> None:
    keys = JobKeys("ns", "job")
    telemetry = Telemetry(client, keys, node=0, pod="p")
    reader = JobRedis(client, keys)
    assert await reader.new_iterations() == []  # the operator starts at the stream's end
    for step in range(5):
        await telemetry.record_iteration(generation=0, step=step, seconds=0.1 + step / 100, samples=4)
    records = await reader.new_iterations()
    assert [r.step for r in records] == [0, 1, 2, 3, 4]
    assert records[-1].seconds == pytest.approx(0.14)
    assert await reader.new_iterations() == []


async def test_the_step_and_its_loss_reach_the_stream_and_the_gauges(client: aioredis.Redis) -> None:
    from prometheus_client import REGISTRY

    keys = JobKeys("ns", "loss")
    telemetry = Telemetry(client, keys, node=0, pod="p")
    reader = JobRedis(client, keys)
    await reader.new_iterations()
    await telemetry.record_iteration(0, 7, 0.1, 4, loss=2.5)
    assert REGISTRY.get_sample_value("rjob_agent_step") == 7
    assert REGISTRY.get_sample_value("rjob_agent_loss") == 2.5
    # A diverged step reports no loss (the record refuses a non-finite one) and leaves the gauge alone.
    await telemetry.record_iteration(0, 8, 0.1, 4, loss=float("nan"))
    assert REGISTRY.get_sample_value("rjob_agent_step") == 8
    assert REGISTRY.get_sample_value("rjob_agent_loss") == 2.5
    assert [(r.step, r.loss) for r in await reader.new_iterations()] == [(7, 2.5), (8, None)]
    with pytest.raises(ValueError, match="loss"):
        IterationRecord(node=0, generation=0, step=1, seconds=0.2, samples=4, sent_at=0, loss=float("inf"))


async def test_garbage_in_the_streams_is_counted_and_ignored(client: aioredis.Redis) -> None:
    keys = JobKeys("ns", "garbage")
    reader = JobRedis(client, keys)
    await reader.new_iterations()
    before = {reason: dropped("operator.iterations", reason) for reason in DropReason}
    good = IterationRecord(node=0, generation=0, step=1, seconds=0.2, samples=4, sent_at=time.time())
    await client.xadd(keys.iterations, {"m": b"\xff\xfe not utf8"})
    await client.xadd(keys.iterations, {"m": b"{not json"})
    await client.xadd(keys.iterations, {"m": b'{"node": -1, "generation": 0}'})
    await client.xadd(keys.iterations, {"m": b'{"seconds": NaN}'})
    await client.xadd(keys.iterations, {"m": b"x" * (MAX_MESSAGE_BYTES + 1)})
    await client.xadd(keys.iterations, {"m": b"[" * 100_00})
    await client.xadd(keys.iterations, {"other": b"field"})
    await client.xadd(keys.iterations, {"m": good.model_dump_json().encode()})
    records = await reader.new_iterations()
    assert records == [good]
    after = {reason: dropped("operator.iterations", reason) for reason in DropReason}
    assert after[DropReason.OVERSIZED] - before[DropReason.OVERSIZED] == 1
    assert after[DropReason.MALFORMED] - before[DropReason.MALFORMED] >= 3
    assert sum(after.values()) - sum(before.values()) == 7


async def test_plan_announcements_reach_the_agent_and_garbage_is_dropped(client: aioredis.Redis) -> None:
    keys = JobKeys("ns", "plans")
    operator_side = JobRedis(client, keys)
    await operator_side.announce(announcement(two_node_plan(0)))
    agent = Telemetry(client, keys, node=0, pod="p")
    stopped = asyncio.Event()
    received: list[PlanAnnouncement] = []

    async def listen() -> None:
        async for message in agent.plan_updates(stopped):
            received.append(message)
            if message.generation == 1:
                stopped.set()

    listener = asyncio.create_task(listen())
    await asyncio.sleep(0.3)
    before = dropped("agent.plan", DropReason.MALFORMED)
    await client.publish(keys.plan_channel, b"garbage")
    await operator_side.announce(announcement(two_node_plan(1)))
    await asyncio.wait_for(listener, 3)
    assert [m.generation for m in received] == [0, 1]
    assert dropped("agent.plan", DropReason.MALFORMED) == before + 1


def test_decode_never_raises_on_hostile_input() -> None:
    for raw in (b"", b"null", b"1e999999", b'{"node": "0"' * 1000, "\u0000", b'{"__class__": 1}'):
        assert decode(IterationRecord, raw, "test") is None


async def test_bocd_reports_slowdown_then_recovery_to_the_reports_stream(client: aioredis.Redis) -> None:
    keys = JobKeys("default", "cp")
    agent = Telemetry(client, keys, node=3, pod="cp-node-3")
    rng = random.Random(7)
    times = [0.1] * 40 + [0.15] * 30 + [0.1] * 30
    reports = []
    for step, base in enumerate(times, start=1):
        report = await agent.record_iteration(0, step, base * (1 + 0.01 * rng.gauss(0, 1)), 4)
        if report is not None:
            reports.append(report)
    assert [r.recovered for r in reports] == [False, True]
    slow, back = reports
    assert 41 <= slow.onset_step <= slow.step <= 41 + 10  # BOCD confirms within its window
    assert slow.slowdown == pytest.approx(1.5, rel=0.05) and slow.baseline_s == pytest.approx(0.1, rel=0.05)
    assert slow.level_s == pytest.approx(0.15, rel=0.05)
    assert 71 <= back.onset_step <= back.step <= 71 + 10 and back.slowdown < 1
    stored = await JobRedis(client, keys).new_reports()
    assert [(r.node, r.step, r.recovered) for r in stored] == [(3, slow.step, False), (3, back.step, True)]


async def test_a_new_generation_restarts_detection(client: aioredis.Redis) -> None:
    agent = Telemetry(client, JobKeys("default", "gen"), node=0, pod="gen-node-0")
    for step in range(1, 31):
        assert await agent.record_iteration(0, step, 0.1, 1) is None
    # The new layout is slower for everyone: a new baseline, not a fail-slow.
    reports = [await agent.record_iteration(1, step, 0.2, 1) for step in range(31, 61)]
    assert reports == [None] * 30


async def test_compute_split_blames_the_slow_node_and_reports_links_as_communication(
    client: aioredis.Redis,
) -> None:
    keys = JobKeys("default", "split")
    rng = random.Random(3)

    def jitter(value: float) -> float:
        return value * (1 + 0.02 * rng.gauss(0, 1))

    async def run(node: int, steps: list[tuple[float, float]]) -> list[SlowReport]:
        agent = Telemetry(client, keys, node=node, pod=f"split-node-{node}")
        found = []
        for step, (compute, communication) in enumerate(steps, start=1):
            c, m = jitter(compute), jitter(communication)
            report = await agent.record_iteration(0, step, c + m, 2, "role", compute_s=c, communication_s=m)
            if report is not None:
                found.append(report)
        return found

    # Node 1's compute slows 1.5x from step 41; node 0 waits for it: its communication grows, not compute.
    slow = await run(1, [(0.1, 0.02)] * 40 + [(0.15, 0.02)] * 30)
    waiting = await run(0, [(0.1, 0.02)] * 40 + [(0.1, 0.07)] * 30)
    # Node 2's link slows: only its communication grows.
    link = await run(2, [(0.1, 0.02)] * 40 + [(0.1, 0.08)] * 30)
    assert [(r.kind, r.recovered) for r in slow] == [(SlowKind.COMPUTE, False)]
    assert slow[0].step - 40 <= 10 and slow[0].slowdown == pytest.approx(1.5, rel=0.05)
    assert [r.kind for r in waiting] == [SlowKind.COMMUNICATION]
    assert [r.kind for r in link] == [SlowKind.COMMUNICATION] and link[0].slowdown > 1.4
    stored = [IterationRecord.model_validate_json(f[b"m"]) for _, f in await client.xrange(keys.iterations)]
    assert all(r.compute_s is not None and r.communication_s is not None for r in stored)


async def test_a_drained_node_reports_its_probes_recovery_and_not_the_jobs_step(
    client: aioredis.Redis,
) -> None:
    """A drained node waits out its peers' steps: the job speeding up (its wall falling) is no recovery of
    the node, which its probe's compute alone says (the operator has no level of it to check the word)."""
    agent = Telemetry(client, JobKeys("default", "drained"), node=5, pod="drained-node-5")
    rng = random.Random(5)
    # Walls: the job's step falls 0.2 -> 0.1 s at step 41; the node's probe stays 4x slow until step 71.
    steps = [(0.2 if step <= 40 else 0.1, 0.004 if step <= 70 else 0.001) for step in range(1, 101)]
    reports = []
    for step, (wall, probe) in enumerate(steps, start=1):
        jitter = 1 + 0.01 * rng.gauss(0, 1)
        report = await agent.record_iteration(
            1, step, wall * jitter, 0, DRAINED_ROLE, compute_s=probe * jitter, communication_s=wall
        )
        if report is not None:
            reports.append(report)
    assert [(r.kind, r.recovered) for r in reports] == [(SlowKind.COMPUTE, True)]
    assert 71 <= reports[0].onset_step <= reports[0].step <= 71 + 10


@pytest.mark.parametrize("role", [DRAINED_ROLE, PARKED_ROLE])
async def test_a_probes_passing_bump_is_no_recovery_and_its_fall_is(
    client: aioredis.Redis, role: str
) -> None:
    """A probe's level rising for a while (cache contention on a shared host) and coming back is not the
    node's recovery; a fall under its first level is."""
    agent = Telemetry(client, JobKeys("default", "bump"), node=7, pod="bump-node-7")
    rng = random.Random(11)
    levels = [0.0045] * 60 + [0.0065] * 40 + [0.0045] * 60 + [0.0011] * 40
    reports = []
    for step, level in enumerate(levels, start=1):
        probe = level * (1 + 0.02 * rng.gauss(0, 1))
        report = await agent.record_iteration(1, step, 0.1, 0, role, compute_s=probe, communication_s=0.1)
        if report is not None:
            reports.append(report)
    recoveries = [r for r in reports if r.recovered]
    assert len(recoveries) == 1 and recoveries[0].onset_step >= 161, reports
    assert recoveries[0].level_s == pytest.approx(0.0011, rel=0.1)


async def test_warmup_steps_are_recorded_but_not_detected(client: aioredis.Redis) -> None:
    keys = JobKeys("default", "warm")
    agent = Telemetry(client, keys, node=0, pod="warm-node-0", warmup=5)
    # A slow start-up (first steps 3x) must not become the baseline, nor a "recovery".
    times = [0.3] * 5 + [0.1] * 40
    reports = [
        await agent.record_iteration(0, step, value, 1, "r") for step, value in enumerate(times, start=1)
    ]
    assert reports == [None] * len(times)
    assert await client.xlen(keys.iterations) == len(times)
    with pytest.raises(ValueError, match="warmup"):
        Telemetry(client, keys, node=0, pod="p", warmup=-1)


async def test_profiles_go_to_their_stream(client: aioredis.Redis) -> None:
    keys = JobKeys("default", "prof")
    agent = Telemetry(client, keys, node=2, pod="prof-node-2")
    sent = await agent.record_profile(
        generation=1,
        step=20,
        iterations=9,
        iteration_s=0.2,
        compute_s=0.15,
        communication_s=0.05,
        groups={"0,1,2,3": 0.05, "2,3@3": 0.01},
    )
    ((_, fields),) = await client.xrange(keys.profiles)
    assert ProfileRecord.model_validate_json(fields[b"m"]) == sent and sent.groups["2,3@3"] == 0.01


def test_bad_detector_settings_name_the_field() -> None:
    with pytest.raises(PlannerError, match="threshold"):
        DetectorConfig(threshold=1.0)


def test_dropped_messages_are_exported_once_whoever_imports_the_metrics() -> None:
    # The agent's and the operator's metrics share a process in the local stack: one family, counting
    # what `decode` dropped.
    from prometheus_client import REGISTRY, generate_latest

    import resilientjob.operator.metrics  # noqa: F401 - registers its side too
    from resilientjob.protocol.messages import Heartbeat, decode

    def dropped() -> float:
        value = REGISTRY.get_sample_value(
            "rjob_telemetry_dropped_total", {"source": "test.export", "reason": "malformed"}
        )
        return value or 0.0

    before = dropped()
    assert decode(Heartbeat, b"\xff not json", "test.export") is None
    assert dropped() == before + 1
    assert generate_latest(REGISTRY).decode().count("# TYPE rjob_telemetry_dropped_total counter") == 1
