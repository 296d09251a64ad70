"""The operator's batched Redis reads against a real redis-server: one script call for every node's
heartbeat TTL (with the agents' has-beaten bitmap and the committed generation), fencing, and length-framed
stream reads that drop hostile entries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from resilientjob.agent.telemetry import Telemetry
from resilientjob.operator._redis_state import JobRedis, announcement, node_list
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import DropReason, dropped

KEYS = JobKeys("default", "scan")


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


async def test_one_scan_reports_live_expired_and_never_started_nodes(client: aioredis.Redis) -> None:
    state = JobRedis(client, KEYS)
    agents = [Telemetry(client, KEYS, node, f"scan-node-{node}") for node in range(6)]
    for agent in agents[:4]:
        await agent.beat()  # nodes 0-3 beat (key + bitmap); 4 and 5 never start
    await client.delete(KEYS.heartbeat(2))  # node 2's key expired
    await client.set(KEYS.heartbeat(5), b"{}", px=1500)  # a bare key counts as alive too
    nodes = np.arange(6, dtype=np.int64)
    scan = await state.scan(nodes, node_list(nodes.tolist()))
    assert scan.live.tolist() == [True, True, False, True, False, True]
    assert 1.5 < float(scan.left_s[0]) <= 2.0 and 1.0 < float(scan.left_s[5]) <= 1.5
    assert scan.expired == [2]  # node 4 never beat: judged by its pod, not flagged
    assert scan.generation is None  # nothing committed yet
    await state.fence(3)
    after = await state.scan(nodes, node_list(nodes.tolist()))
    assert not after.live[3] and 3 not in after.expired  # a replacement must beat before silence counts
    assert await state.live_heartbeats([0, 1, 2]) == pytest.approx({0: 2.0, 1: 2.0}, abs=0.1)


async def test_stream_reads_are_incremental_and_drop_hostile_entries(client: aioredis.Redis) -> None:
    state = JobRedis(client, KEYS)
    assert await state.new_iterations() == []  # the operator starts at the stream's end
    agent = Telemetry(client, KEYS, 1, "scan-node-1")
    before_invalid = dropped("operator.iterations", DropReason.INVALID)
    before_malformed = dropped("operator.iterations", DropReason.MALFORMED)
    await agent.record_iteration(0, 1, 0.5, 4)
    await client.xadd(KEYS.iterations, {"m": b"\xff\x00 not json\n{}"})
    await client.xadd(KEYS.iterations, {"other": b"x"})
    await agent.record_iteration(0, 2, 0.25, 4)
    records = await state.new_iterations()
    assert [(r.step, r.seconds) for r in records] == [(1, 0.5), (2, 0.25)]
    assert dropped("operator.iterations", DropReason.INVALID) == before_invalid + 1
    assert dropped("operator.iterations", DropReason.MALFORMED) == before_malformed + 1
    assert await state.new_iterations() == []
    await agent.record_iteration(0, 3, 0.3, 4)
    assert [r.step for r in await state.new_iterations(count=10)] == [3]


async def test_a_restarted_operator_reads_the_newest_iteration_it_never_saw(client: aioredis.Redis) -> None:
    """Which generation the workers last stepped under, for an operator that has read no record yet (it
    reads only those after its start): a join must not take a long-confirmed restart for an unconfirmed
    one."""
    keys = JobKeys("default", "latest")
    state = JobRedis(client, keys)
    assert await state.latest_iteration() is None
    agent = Telemetry(client, keys, 0, "latest-node-0")
    await agent.record_iteration(4, 120, 0.5, 4)
    await agent.record_iteration(5, 121, 0.5, 4)
    latest = await state.latest_iteration()
    assert latest is not None and (latest.generation, latest.step) == (5, 121)
    await client.xadd(keys.iterations, {"m": b"not json"})
    assert await state.latest_iteration() is None  # garbage is not trusted


def test_every_key_of_a_job_hashes_to_one_cluster_slot() -> None:
    from redis.crc import key_slot

    keys = JobKeys("team-a", "llama")
    names = [
        keys.heartbeat(0),
        keys.heartbeat(4095),
        keys.beaten,
        keys.plan,
        keys.plan_generation,
        keys.plan_channel,
        keys.iterations,
        keys.reports,
        keys.profiles,
        keys.validation_request,
        keys.validation_results,
        keys.chaos(3),
        f"{keys.prefix}failslow",
    ]
    assert keys.prefix == "rjob:{team-a/llama}:"
    assert {key_slot(name.encode()) for name in names} == {key_slot(b"team-a/llama")}
    # Another job's keys land elsewhere (jobs spread over the shards).
    assert key_slot(JobKeys("team-a", "other").plan.encode()) != key_slot(keys.plan.encode())


async def test_failslow_state_and_validation_requests_round_trip(client: aioredis.Redis) -> None:
    state = JobRedis(client, KEYS)
    assert await state.load_failslow() is None
    first = await state.request_validation(3, [5, 2, 5], "suspects")
    second = await state.request_validation(3, [1], "again")
    assert (first.id, second.id, first.suspects) == (1, 2, [2, 5])  # ids only grow
    state.reports_cursor = "17-0"
    await state.save_failslow({"slow": {"1": 2.0}})
    restarted = JobRedis(client, KEYS)
    assert await restarted.load_failslow() == {"slow": {"1": 2.0}}
    assert restarted.reports_cursor == "17-0"  # old reports are not replayed into the restored episode
    # A mitigation's commit stores the episode's state in the same transaction as the plan.
    plan = Plan(policy=Policy.DYNAMIC, microbatch_size=1, pipelines=(_one_stage(0),), step_time_s=1.0)
    message = announcement(plan)
    await state.announce(message, {"slow": {"3": 1.5}})
    assert await JobRedis(client, KEYS).load_failslow() == {"slow": {"3": 1.5}}
    assert await state.published() == message
    before = dropped("operator.failslow", DropReason.INVALID)
    await client.set(state.keys.failslow, b'{"state": [], "reports_cursor": "x"}')
    assert await JobRedis(client, KEYS).load_failslow() is None
    assert dropped("operator.failslow", DropReason.INVALID) == before + 1


def _one_stage(node: int) -> PipelinePlan:
    return PipelinePlan(stages=(StagePlan(layers=(0, 2), node=node),), microbatches=4)


async def test_a_workload_error_an_agent_left_is_read_back_and_garbage_is_not(client: aioredis.Redis) -> None:
    keys = JobKeys("ns", "workload-errors")
    state = JobRedis(client, keys)
    assert await state.workload_error() is None
    await client.hset(
        keys.workload_errors,
        mapping={
            "x": "workload: spec.data.path: not a node",
            "3": "workload: spec.data.path: /d/t.bin: sample 9 holds token 53",
            "1": "spec.data.path: no prefix",
            "2": b"\xff\xfe",
            "5": "workload: spec.output.path: /o: read-only",
        },
    )
    assert await state.workload_error() == (
        3,
        "spec.data.path",
        "spec.data.path: /d/t.bin: sample 9 holds token 53",
    )


async def test_a_new_job_of_a_deleted_jobs_name_starts_from_clean_keys(client: aioredis.Redis) -> None:
    """The deleted job's agents wrote on after its keys were forgotten: their heartbeat bitmap then made
    the new job fence its own workers as they started (never beaten, yet 'beaten and silent')."""
    keys = JobKeys("ns", "same-name")
    old = JobRedis(client, keys)
    assert await old.claim("uid-old") == 0  # nothing there yet
    await client.setbit(keys.beaten, 5, 1)
    await client.xadd(keys.iterations, {"m": b"{}"})
    new = JobRedis(client, keys)
    assert await new.claim("uid-new") == 2  # the bitmap and the stream (the owner is overwritten)
    assert await client.getbit(keys.beaten, 5) == 0 and await client.exists(keys.iterations) == 0
    await client.setbit(keys.beaten, 1, 1)  # the new job's own agents
    assert await new.claim("uid-new") == 0  # a restarted operator of the same job keeps them
    assert await client.getbit(keys.beaten, 1) == 1
    # Redis lost its state (the owner with it) and the job's agents wrote again before a restarted
    # operator claimed the keys: a job that has run keeps them; a new one would take them for leftovers.
    await client.delete(keys.owner)
    assert await new.claim("uid-new", started=True) == 0 and await client.getbit(keys.beaten, 1) == 1
    assert await client.get(keys.owner) == b"uid-new"
    # A claim cut short (Redis gone in the middle of the deletion) is finished by its retry.
    again = JobKeys("ns", "cut-short")
    await client.set(again.owner, "claiming:uid-new")
    await client.setbit(again.beaten, 3, 1)
    assert await JobRedis(client, again).claim("uid-new") == 1
    assert await client.exists(again.beaten) == 0 and await client.get(again.owner) == b"uid-new"


async def test_a_deleted_jobs_agent_is_refused_once_a_new_job_owns_the_keys(client: aioredis.Redis) -> None:
    """A pod of a deleted job stuck terminating on a node cut off from the API server (not from Redis) beats
    on: it must not keep a node of the new job of that name alive, nor set its `beaten` bit (which fences
    that node's new worker as it starts), nor append steps to its streams."""
    keys = JobKeys("ns", "zombie")
    await JobRedis(client, keys).claim("uid-old")
    stale = Telemetry(client, keys, 4, "zombie-node-4", job_uid="uid-old", superseded_after_s=0.3)
    await stale.beat()
    assert await client.exists(keys.heartbeat(4)) == 1  # its own job's keys: written
    await JobRedis(client, keys).claim("uid-new")
    assert await client.exists(keys.heartbeat(4)) == 0 and await client.getbit(keys.beaten, 4) == 0
    await stale.beat()  # refused, written nowhere; one refusal alone stops nothing
    assert not stale.superseded and stale.refusals.since is not None
    assert not await stale._send(keys.iterations, b"{}", keep=False)
    stopped = asyncio.Event()
    await asyncio.wait_for(stale.heartbeat_forever(stopped), 5)
    assert stopped.is_set() and stale.superseded  # refused for the grace: the whole agent stops
    assert (
        await client.exists(keys.heartbeat(4), keys.iterations) == 0
        and await client.getbit(keys.beaten, 4) == 0
    )
    # The new job's agents, and an agent started by hand (no uid), beat and append.
    fresh = Telemetry(client, keys, 4, "zombie-node-4", job_uid="uid-new")
    await fresh.beat()
    assert await fresh.record_iteration(0, 1, 0.1, 2) is None and await client.xlen(keys.iterations) == 1
    await Telemetry(client, keys, 5, "by-hand").beat()
    assert await client.exists(keys.heartbeat(4), keys.heartbeat(5)) == 2
    # Redis reloaded an older state that names the deleted job: the new job's agents are refused, the
    # operator's next scan sets the owner back, and they are accepted again before their grace is out.
    state = JobRedis(client, keys)
    await state.claim("uid-new")
    await client.set(keys.owner, "uid-old")
    await fresh.beat()
    assert fresh.refusals.since is not None
    await state.scan(np.asarray([4]), node_list([4]))
    assert await client.get(keys.owner) == b"uid-new"
    await fresh.beat()
    assert fresh.refusals.since is None and not fresh.superseded
    # Redis lost its state: the owner comes back with the plan the operator restores.
    await client.flushdb()
    plan = Plan(policy=Policy.DYNAMIC, microbatch_size=1, pipelines=(_one_stage(0),), step_time_s=1.0)
    await state.announce(announcement(plan))
    assert await client.get(keys.owner) == b"uid-new"


def test_a_step_record_reaches_an_operator_of_the_schema_before_the_switch_fields() -> None:
    """Worker pods run the job's image, which may be newer than the operator's: a record carries the fields
    only a generation's first step sets only when they are set, since the older schema forbids unknown
    fields (it dropped every record of a newer agent)."""
    import json

    from resilientjob.protocol.messages import IterationRecord, encode

    plain = IterationRecord(node=1, generation=2, step=3, seconds=0.1, samples=4, sent_at=1.0, compute_s=0.08)
    assert set(json.loads(encode(plain))) == {
        "node",
        "generation",
        "step",
        "seconds",
        "samples",
        "sent_at",
        "compute_s",
    }
    first = plain.model_copy(update={"rendezvous_s": 0.04, "copy_s": 0.08, "copied_bytes": 512})
    assert {"rendezvous_s", "copy_s", "copied_bytes"} <= set(json.loads(encode(first)))
