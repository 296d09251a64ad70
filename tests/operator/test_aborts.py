"""A world that stopped with every node alive (`operator/_aborts`): the rule that re-forms it or fences the
nodes that hang, and the agents' reports of abandoned steps through a real Redis (`Telemetry.record_abort`,
the scan's count, `JobRedis.aborts`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from resilientjob.agent.telemetry import Telemetry
from resilientjob.operator import api
from resilientjob.operator._aborts import (
    ABORT_GRACE_S,
    MAX_REFORMS,
    REFORM_GRACE_S,
    AbortWatch,
    Verdict,
    copies_to_carry,
    hang_after_s,
    judge,
    summary,
    switch_failed,
)
from resilientjob.operator._redis_state import JobRedis, announcement, node_list
from resilientjob.operator._store import rendezvous_again
from resilientjob.planner.plan import Candidate, PipelinePlan, Plan, Policy, StagePlan, Transfer
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import WorkerAbort, abort_line, encode

WORLD = frozenset({0, 1, 2, 3})


def _abort(
    node: int, generation: int = 4, at: float = 100.0, error: str = "PeerFailure: no progress"
) -> WorkerAbort:
    return WorkerAbort(
        node=node,
        generation=generation,
        step=17,
        error=error,
        collective_timeout_s=5.0,
        plan_timeout_s=120.0,
        at=at,
    )


def _aborts(*nodes: int, generation: int = 4) -> dict[int, WorkerAbort]:
    return {node: _abort(node, generation) for node in nodes}


def test_every_node_aborted_re_forms_after_a_short_grace_and_others_wait_for_the_fail_stop_path() -> None:
    everyone = _aborts(0, 1, 2, 3)
    # A dead node reports no abort: a world whose every node did is alive. It waits only for a pod that
    # failed just after its abort to show, not the heartbeat TTL's grace (3 s was the whole of a break).
    assert judge(WORLD, everyone, REFORM_GRACE_S - 0.1) is None
    assert judge(WORLD, everyone, REFORM_GRACE_S) == Verdict(reform=True)
    assert REFORM_GRACE_S < ABORT_GRACE_S
    # Some nodes silent: a death is the fail-stop path's, which fences it within the grace.
    assert judge(WORLD, _aborts(0, 1, 2), ABORT_GRACE_S - 0.1) is None


def test_nodes_that_neither_aborted_nor_stepped_hang_after_two_collective_timeouts() -> None:
    some = _aborts(0, 2, 3)
    waited = hang_after_s(some)
    assert waited == pytest.approx(2 * 5.0 + ABORT_GRACE_S)
    assert judge(WORLD, some, waited - 0.1) is None  # a peer blocked behind another may still abort
    assert judge(WORLD, some, waited) == Verdict(hung=(1,))
    # A collective timeout as long as the plan timeout: the aborted nodes would give up before the verdict.
    patient = {n: a.model_copy(update={"collective_timeout_s": 100.0}) for n, a in some.items()}
    assert hang_after_s(patient) == pytest.approx(60.0)


def test_aborts_of_nodes_outside_the_world_count_for_nothing() -> None:
    assert judge(WORLD, _aborts(7), 60.0) is None
    assert judge(frozenset({0, 1}), _aborts(0, 1, 7), ABORT_GRACE_S) == Verdict(reform=True)


def test_the_summary_names_the_node_that_aborted_first_and_its_error() -> None:
    aborts = {
        0: _abort(0, at=105.0, error="PeerFailure: gradient all-reduce: no progress within 5.0 s"),
        2: _abort(2, at=100.0, error="BrokenOnOrder: chaos: all_reduce broken on order"),
    }
    assert summary(aborts) == (
        "nodes [0, 2] abandoned step 17 (first node 2: BrokenOnOrder: chaos: all_reduce broken on order)"
    )


def test_the_watch_clocks_each_generation_from_its_first_abort() -> None:
    watch = AbortWatch()
    assert watch.observe(4, WORLD, {}, now=10.0) is None
    assert watch.observe(4, WORLD, _aborts(0), now=20.0) is None  # the clock starts here
    # The last node reported at 21: the short grace counts from there, not from the first abort.
    assert watch.observe(4, WORLD, _aborts(0, 1, 2, 3), now=21.0) is None
    assert watch.observe(4, WORLD, _aborts(0, 1, 2, 3), now=21.0 + REFORM_GRACE_S - 0.1) is None
    assert watch.observe(4, WORLD, _aborts(0, 1, 2, 3), now=21.0 + REFORM_GRACE_S) == Verdict(reform=True)
    # A new generation starts a new clock.
    assert watch.observe(5, WORLD, _aborts(0, 1, 2, 3, generation=5), now=40.0) is None
    assert watch.waited_s(41.0) == pytest.approx(1.0)


def test_a_re_formation_in_a_row_waits_the_full_grace_so_a_flapping_link_keeps_its_budget() -> None:
    """Three quick re-formations took 3-4 s: a link flapping for 5-10 s would have spent MAX_REFORMS."""
    watch = AbortWatch()
    assert watch.observe(4, WORLD, _aborts(0, 1, 2, 3), now=10.0) is None
    assert watch.observe(4, WORLD, _aborts(0, 1, 2, 3), now=10.0 + REFORM_GRACE_S) == Verdict(reform=True)
    watch.reforming(5)  # and the re-formed world aborts again before it commits a step
    everyone = _aborts(0, 1, 2, 3, generation=5)
    assert watch.observe(5, WORLD, everyone, now=20.0) is None
    assert watch.observe(5, WORLD, everyone, now=20.0 + ABORT_GRACE_S - 0.1) is None
    assert watch.observe(5, WORLD, everyone, now=20.0 + ABORT_GRACE_S) == Verdict(reform=True)
    watch.reforming(6)
    watch.stepped(6)  # it trains again: the next break is quick again
    assert watch.observe(6, WORLD, _aborts(0, 1, 2, 3, generation=6), now=30.0) is None
    assert watch.observe(6, WORLD, _aborts(0, 1, 2, 3, generation=6), now=30.0 + REFORM_GRACE_S) == Verdict(
        reform=True
    )


def test_re_formations_stop_after_the_limit_until_a_step_commits() -> None:
    watch = AbortWatch()
    for generation in range(5, 5 + MAX_REFORMS):
        assert watch.may_reform()
        watch.reforming(generation)
        watch.stepped(generation - 1)  # a step of the generation before the re-formation proves nothing
    assert not watch.may_reform()
    watch.stepped(4 + MAX_REFORMS)  # the latest re-formed world trained a step
    assert watch.may_reform()


def test_a_re_formed_world_keeps_the_layout_and_copies_nothing_again() -> None:
    pipelines = tuple(
        PipelinePlan(stages=(StagePlan(layers=(0, 2), node=node),), microbatches=4) for node in (0, 2)
    )
    # Generation 6 took node 2 in with layers copied from node 5, which left the job.
    copied = (Transfer(layer=0, src=5, dst=2, bytes=8), Transfer(layer=1, src=5, dst=2, bytes=8))
    plan = Plan(
        generation=6, policy=Policy.TEMPLATES, microbatch_size=1, pipelines=pipelines, step_time_s=1.0
    ).model_copy(
        update={
            "transfers": copied,
            "planning_s": 0.4,
            "candidates": (
                Candidate(policy=Policy.TEMPLATES, layout="DP2", step_time_s=1, transition_s=0, score=2),
            ),
        }
    )
    current = announcement(plan, trigger="NodeJoined", nodes=[2], parked=[7])
    carried = copies_to_carry(plan, _aborts(0, 2, generation=6))  # every node got past the copies
    reformed = rendezvous_again(
        current, api.Reason.COLLECTIVE_FAILED, "nodes [0, 2] abandoned step 9", transfers=carried
    )
    assert reformed.generation == 7 and reformed.trigger == "CollectiveFailed" and reformed.nodes == []
    assert reformed.plan.pipelines == plan.pipelines and reformed.plan.policy is Policy.DYNAMIC
    assert reformed.plan.transfers == () and reformed.parked == [7]  # node 5 is not waited for
    assert reformed.plan.candidates == () and reformed.plan.planning_s == 0  # no planner ran
    assert rendezvous_again(current).plan.transfers == copied  # a replaced store may have cut copies short


def test_after_a_failed_switch_its_copies_and_its_restart_are_carried_again() -> None:
    """Node 2 failed in the switch to generation 6 (a copy, or its rendezvous); node 0 got through and
    abandoned the first step. Every copy goes again, node 5's too (it only sends): the workers skip those
    that landed (`agent.p2p.switch_copies`), and no source drops a layer before every receiver holds its
    own, so node 5 still holds what it has to send, and waits for the next generation like the others."""
    pipelines = tuple(
        PipelinePlan(stages=(StagePlan(layers=(0, 3), node=node),), microbatches=4) for node in (0, 2)
    )
    transfers = (Transfer(layer=0, src=0, dst=2, bytes=8), Transfer(layer=1, src=5, dst=2, bytes=8))
    plan = Plan(
        generation=6, policy=Policy.DYNAMIC, microbatch_size=1, pipelines=pipelines, step_time_s=1.0
    ).model_copy(update={"transfers": transfers})
    aborts = {0: _abort(0, generation=6), 2: _abort(2, generation=6).model_copy(update={"switching": True})}
    assert switch_failed(aborts) and copies_to_carry(plan, aborts) == transfers
    stepped = {0: aborts[0], 2: _abort(2, generation=6)}
    assert not switch_failed(stepped) and copies_to_carry(plan, stepped) == ()
    assert summary(aborts).startswith("nodes [0, 2] abandoned the switch to generation 6 (first node 0: ")
    # Sent only when set: an operator of the older schema (which forbids fields it does not know) still
    # reads the aborts of a newer agent that abandoned a step.
    assert b"switching" not in encode(aborts[0]) and b'"switching":true' in encode(aborts[2])
    # A restart from the checkpoint whose switch failed restarts again: as `dynamic`, a node whose restore
    # had not completed would train on what it held (with tensor parallelism, its initial weights).
    restart = announcement(plan.model_copy(update={"policy": Policy.CHECKPOINT, "transfers": ()}))
    again = rendezvous_again(restart, api.Reason.COLLECTIVE_FAILED, "-", transfers=(), restart_again=True)
    assert again.plan.policy is Policy.CHECKPOINT and again.generation == 7
    assert rendezvous_again(restart, api.Reason.COLLECTIVE_FAILED, "-").plan.policy is Policy.DYNAMIC


def test_abort_line_keeps_the_first_line_of_a_long_error() -> None:
    error = RuntimeError(
        "\n  [../gloo/transport/tcp/pair.cc:534] Connection closed by peer\n" + "frame\n" * 50
    )
    assert abort_line(error) == "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    assert len(abort_line("x" * 5000)) == 300


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


async def test_agents_report_aborts_and_the_operator_reads_the_current_generation_only(
    client: aioredis.Redis,
) -> None:
    keys = JobKeys("default", "aborts")
    await client.delete(keys.aborts, keys.owner)
    state = JobRedis(client, keys)
    nodes = np.arange(3, dtype=np.int64)
    assert (await state.scan(nodes, node_list([0, 1, 2]))).aborts == 0
    for node in range(3):
        agent = Telemetry(client, keys, node, f"aborts-node-{node}")
        assert await agent.record_abort(3, 40, "PeerFailure: old", 5.0, 120.0) is not None
        sent = await agent.record_abort(4, 41, "RuntimeError: reset\nframe 1\nframe 2", 7.5, 120.0)
        assert sent is not None and sent.error == "RuntimeError: reset"
    await client.hset(keys.aborts, "4:9", b"{not json")  # garbage
    await client.hset(keys.aborts, "4:1", encode(_abort(2)))  # a field that does not name its message's node
    await client.hset(keys.aborts, "5:0", encode(_abort(0, generation=5)))  # ahead of the committed one
    await client.hset(keys.aborts, "9:0", encode(_abort(0, generation=9)))  # far ahead: garbage
    assert (await state.scan(nodes, node_list([0, 1, 2]))).aborts == 9
    found = await state.aborts(4)
    assert sorted(found) == [0, 2] and found[0].step == 41 and found[0].collective_timeout_s == 7.5
    # Older generations and garbage are deleted; the next generation's is left for when it is committed.
    assert sorted(await client.hkeys(keys.aborts)) == [b"4:0", b"4:2", b"5:0"]
    # A key of another type would fail every agent's report: deleted.
    await client.delete(keys.aborts)
    await client.set(keys.aborts, b"garbage")
    assert (await state.scan(nodes, node_list([0, 1, 2]))).aborts == -1
    assert await state.aborts(4) == {} and not await client.exists(keys.aborts)


async def test_an_abort_lost_to_a_redis_hiccup_is_sent_again_with_the_next_beat(
    client: aioredis.Redis,
) -> None:
    """A network fault often breaks the collectives and the Redis writes at once: a report lost then would
    get a healthy node taken for hung. The agent sends it with every beat until its node steps again."""
    keys = JobKeys("default", "aborts-again")
    await client.delete(keys.aborts)
    agent = Telemetry(client, keys, 1, "aborts-again-node-1")
    await client.set(keys.aborts, b"not a hash")  # the report's write fails, as on a broken connection
    assert await agent.record_abort(6, 12, "PeerFailure: no progress", 5.0, 120.0) is None
    assert agent.waiting is not None and agent.waiting.generation == 6
    await client.delete(keys.aborts)  # the connection is back
    stopped = asyncio.Event()
    beating = asyncio.create_task(agent.heartbeat_forever(stopped))
    try:
        for _ in range(50):
            if await client.hexists(keys.aborts, "6:1"):
                break
            await asyncio.sleep(0.05)
        assert await client.hexists(keys.aborts, "6:1")
        await agent.record_iteration(7, 13, 0.1, 4)  # the generation it waited for: no more resends
        assert agent.waiting is None
    finally:
        stopped.set()
        await beating
        await client.delete(keys.aborts, keys.heartbeat(1), keys.beaten, keys.iterations)


async def test_an_agent_of_a_deleted_job_cannot_report_aborts_into_the_new_jobs_keys(
    client: aioredis.Redis,
) -> None:
    keys = JobKeys("default", "aborts-fenced")
    await client.set(keys.owner, "uid-of-the-new-job")
    old = Telemetry(client, keys, 0, "aborts-fenced-node-0", job_uid="uid-of-the-deleted-job")
    assert await old.record_abort(2, 9, "PeerFailure", 5.0, 120.0) is None
    assert await client.hlen(keys.aborts) == 0
    await client.delete(keys.owner)


async def test_a_node_of_several_devices_is_reported_once_every_device_aborted(
    client: aioredis.Redis,
) -> None:
    """Each device of a node runs its own worker. One that hangs while the others abort is the node
    hanging: reported as aborted, the node would be re-formed with the stuck device, and the rendezvous
    would stall until the plan timeout. So the node's abort goes out once all its devices have said it."""
    from resilientjob.agent._bridge import TrainingAgent
    from resilientjob.agent.config import JobConfig
    from resilientjob.protocol.workload import Workload

    keys = JobKeys("default", "aborts-lanes")
    await client.delete(keys.aborts)
    agent = TrainingAgent(
        Telemetry(client, keys, 3, "aborts-lanes-node-3"), JobConfig(workload=Workload(model="gpt")), "h:1"
    )
    agent.lanes = 2
    line = {"kind": "abort", "generation": 5, "step": 8, "error": "PeerFailure", "collective_timeout_s": 5.0}
    try:
        await agent._forward({**line, "lane": 1, "plan_timeout_s": 120.0, "switching": True})
        assert await client.hlen(keys.aborts) == 0  # device 0 may hang
        await agent._forward({**line, "lane": 0, "plan_timeout_s": 120.0})
        assert await client.hkeys(keys.aborts) == [b"5:3"]
        # Device 1 failed in the switch to generation 5: so did the node, whose copies may be unfinished.
        reported = WorkerAbort.model_validate_json(await client.hget(keys.aborts, "5:3"))
        assert reported.switching is True
    finally:
        agent.stop()
        await client.delete(keys.aborts)
