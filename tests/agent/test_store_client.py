"""A worker's store connection survives the store pod being replaced (issue #14): a real `TCPStore` server in
a process that is killed, a new one elsewhere, and the worker's `ReconnectingStore` following it to the
address the new host registers; what a new store host takes over from Redis (the plan, the failure count)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _support import redis_server
from torch._C._distributed_c10d import PrefixStore
from torch.distributed import DistNetworkError

from resilientjob.agent._redis import connect
from resilientjob.agent._store_client import ReconnectingStore
from resilientjob.agent.store_host import StoreHost
from resilientjob.agent.telemetry import Refusals
from resilientjob.operator._redis_state import JobRedis, announcement
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan, Transfer
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.store_keys import FAILURES_KEY, accounted_key

SERVER = """
import time
from datetime import timedelta
from torch._C._distributed_c10d import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
print(store.port, flush=True)
time.sleep(600)
"""


class Server:
    """A store server in its own process, as the store pod's host is."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.address = f"127.0.0.1:{int(self.process.stdout.readline())}"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.kill()


def test_a_lost_store_is_followed_to_its_new_address_and_timeouts_stay_timeouts(
    servers: list[Server], capsys: pytest.CaptureFixture[str]
) -> None:
    servers.append(Server())
    registered = [servers[0].address]
    store = ReconnectingStore(registered[0], lambda: registered[-1], timedelta(seconds=5), give_up_s=20)
    store.set("generation", "3")
    assert store.add("failures", 1) == 1

    servers[0].kill()
    servers.append(Server())
    registered.append(servers[1].address)  # the new host registers its address
    # The call that found the old store gone goes to the new one (which the new host fills).
    assert store.add("failures", 0) == 0
    assert store.reconnects == 1 and store.address == servers[1].address
    assert bytes(store.compare_set("commit/3/0/0", "", "1.0")) == b"1.0"
    store.append("samples/0", "3:1,2;")
    assert store.get("samples/0") == b"3:1,2;" and store.check(["commit/3/0/0"])
    # Gloo rendezvous through a prefix of it, as the runtime builds its groups.
    group = dist.ProcessGroupGloo(PrefixStore("g3", store), 0, 1, timedelta(seconds=5))
    tensor = torch.ones(2)
    group.allreduce([tensor]).wait()
    assert tensor.tolist() == [1.0, 1.0]

    # A key that never comes is a timeout, not a lost store: raised as before, no reconnect.
    store.set_timeout(timedelta(milliseconds=300))
    with pytest.raises(RuntimeError) as raised:
        store.get("never")
    assert not isinstance(raised.value, DistNetworkError)
    assert store.reconnects == 1
    out = capsys.readouterr().out
    assert out.count("store: lost the job's store") == 1 and out.count("store: reconnected") == 1, out


def test_a_store_that_never_comes_back_fails_the_call_after_give_up(
    servers: list[Server], capfd: pytest.CaptureFixture[str]
) -> None:
    servers.append(Server())
    address = servers[0].address
    store = ReconnectingStore(address, lambda: address, timedelta(seconds=5), give_up_s=3.0)
    servers[0].kill()
    started = time.monotonic()
    with pytest.raises(DistNetworkError):
        store.add("failures", 0)
    assert time.monotonic() - started < 12
    # Nothing listens there: no TCPStore client was made to find out, each of whose tries c10d logs with a
    # C++ stack trace into the worker's log (the one broken call is still logged, once).
    err = capfd.readouterr().err
    assert "failed to connect" not in err and err.count("Exception raised from") <= 1, err
    with pytest.raises(ValueError, match="give_up_s"):
        ReconnectingStore(address, lambda: None, timedelta(seconds=1), give_up_s=0)


def _plan(generation: int) -> Plan:
    stages = (StagePlan(layers=(0, 2), node=0), StagePlan(layers=(2, 4), node=1))
    return Plan(
        policy=Policy.DYNAMIC,
        generation=generation,
        microbatch_size=1,
        pipelines=(PipelinePlan(stages=stages, microbatches=4),),
        step_time_s=0.1,
    )


async def test_a_new_store_host_takes_over_the_plan_and_the_failure_count() -> None:
    keys = JobKeys("ns", "takeover")
    with redis_server() as url:
        client = connect(url)
        try:
            await JobRedis(client, keys).announce(announcement(_plan(0)))
            # An earlier host announced two failures and died.
            await client.set(keys.store_failures, 2)
            await client.set(keys.store, "127.0.0.1:1")
            host = StoreHost(client, keys, "127.0.0.1", poll_s=0.02)
            stopped = asyncio.Event()
            running = asyncio.create_task(host.run(stopped))
            deadline = time.monotonic() + 10
            while (await client.get(keys.store)) != host.address.encode():
                assert time.monotonic() < deadline, "the new host never registered"
                await asyncio.sleep(0.02)
            # Registered only with the plan and the count in its store: a reconnecting worker finds both.
            assert host.store.get("generation") == b"0"
            assert int(host.store.add(FAILURES_KEY, 0)) == 2
            assert host.store.get(accounted_key(0)) == b"2"
            stopped.set()
            await asyncio.wait_for(running, 5)
        finally:
            await client.aclose()


async def test_the_store_host_reads_each_generations_plan_once_not_every_poll() -> None:
    # Redis's own idle clock of the plan key tells whether anyone read it: the host polls every 20 ms and
    # must leave the plan alone between generations, and still mirror a new one at once.
    keys = JobKeys("ns", "follow")
    with redis_server() as url:
        client, host_client = connect(url), connect(url)
        try:
            await JobRedis(client, keys).announce(announcement(_plan(0)))
            host = StoreHost(host_client, keys, "127.0.0.1", poll_s=0.02)
            stopped = asyncio.Event()
            running = asyncio.create_task(host.run(stopped))
            deadline = time.monotonic() + 10
            while host.plan is None:
                assert time.monotonic() < deadline, "generation 0 never mirrored"
                await asyncio.sleep(0.02)
            await asyncio.sleep(2.5)
            assert await client.object("idletime", keys.plan) >= 2, "the plan was read between generations"
            await JobRedis(client, keys).announce(announcement(_plan(1)))
            deadline = time.monotonic() + 2
            while host.store.get("generation") != b"1":
                assert time.monotonic() < deadline, "generation 1 not mirrored within 2 s"
                await asyncio.sleep(0.02)
            stopped.set()
            await asyncio.wait_for(running, 5)
        finally:
            await client.aclose()
            await host_client.aclose()


async def test_a_deleted_jobs_store_host_stops_once_a_new_job_of_its_name_owns_the_keys() -> None:
    """A store host left behind by a deleted job (its pod stuck terminating) must not keep pointing the new
    job's workers at its store."""
    keys = JobKeys("ns", "stale-host")
    with redis_server() as url:
        client = connect(url)
        try:
            state = JobRedis(client, keys)
            await state.claim("uid-old")
            await state.announce(announcement(_plan(0)))
            host = StoreHost(client, keys, "127.0.0.1", poll_s=0.02, job_uid="uid-old")
            running = asyncio.create_task(host.run(asyncio.Event()))
            deadline = time.monotonic() + 10
            while (await client.get(keys.store)) != host.address.encode():
                assert time.monotonic() < deadline, "the host never registered"
                await asyncio.sleep(0.02)
            await JobRedis(client, keys).claim("uid-new")  # a new job of the same name
            await client.set(keys.store, "10.0.0.9:29500")  # its own host registers
            # It registers no more at once, and stops on its own after the agents' grace.
            await asyncio.wait_for(running, 5 + Refusals().after_s)
            assert host.superseded and await client.get(keys.store) == b"10.0.0.9:29500"
        finally:
            await client.aclose()


def test_every_rendezvous_waits_for_every_worker_of_its_world() -> None:
    """Workers reach a rendezvous far apart (a fresh start, each reconnecting to a replaced store, a worker
    blocked in a collective until its timeout): none may enter a rendezvous whose timeout is the collective
    timeout long before its peers, or it fails with nobody dead and no newer plan ever comes."""
    from torch._C._distributed_c10d import HashStore

    from resilientjob.agent.worker import await_peers, publish_plan

    store = HashStore()
    plan = _plan(0)
    publish_plan(store, plan, 0)
    started = time.monotonic()
    assert not await_peers(store, plan, node=0, degree=1, timeout_s=0.3)  # alone: gives up, bounded
    assert 0.3 <= time.monotonic() - started < 3
    assert await_peers(store, plan, node=1, degree=1, timeout_s=5)  # the last one in: everyone goes
    assert not await_peers(store, plan, node=0, degree=2, timeout_s=0.1)  # two workers per node: 4 expected
    publish_plan(store, _plan(1), 0)  # a peer died meanwhile: the newer plan decides, nobody waits for it
    started = time.monotonic()
    assert await_peers(store, plan, node=0, degree=3, timeout_s=5)  # 4 of 6 in, but g1 is out
    assert time.monotonic() - started < 2
    assert await_peers(store, plan, node=5, degree=1, timeout_s=5)  # not in the plan: nothing to wait for
    # A job that trained already waits too (a mid-run generation), and a node that only sends layers to the
    # new layout is part of its world: the rendezvous waits for it.
    fresh = HashStore()
    fresh.set("committed", "7")
    moving = _plan(2).model_copy(update={"transfers": (Transfer(layer=0, src=3, dst=1, bytes=8),)})
    publish_plan(fresh, moving, 0)
    assert not await_peers(fresh, moving, node=0, degree=1, timeout_s=0.1)
    assert not await_peers(fresh, moving, node=1, degree=1, timeout_s=0.1)
    assert await_peers(fresh, moving, node=3, degree=1, timeout_s=5)


def test_a_restart_waits_for_every_worker_to_load_the_checkpoint_before_its_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading takes each node its own time (minutes for a large model): the node that loaded first entered
    the rendezvous, waited a collective timeout for the other, and the restart failed with nobody dead."""
    import threading
    from types import SimpleNamespace

    from torch._C._distributed_c10d import HashStore

    from resilientjob.agent import worker

    loaded: dict[int, float] = {}
    entered: dict[int, float] = {}

    def restore(trainer: SimpleNamespace, checkpointer: object, plan: Plan) -> None:
        time.sleep(1.0 if trainer.node == 1 else 0.0)  # node 1's volume is slower
        loaded[trainer.node] = time.monotonic()

    monkeypatch.setattr(worker, "_restore", restore)
    store = HashStore()
    plan = _plan(3).model_copy(update={"policy": Policy.CHECKPOINT})
    worker.publish_plan(store, plan, 0)

    def check_in(node: int) -> None:
        trainer = SimpleNamespace(node=node, degree=1)
        worker.check_in(trainer, store, plan, 10.0, restart=True, checkpointer=None)  # type: ignore[arg-type]
        entered[node] = time.monotonic()

    threads = [threading.Thread(target=check_in, args=(node,)) for node in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert sorted(entered) == [0, 1]
    assert entered[0] >= loaded[1]  # node 0 entered the rendezvous only once node 1 had loaded


def test_a_worker_waiting_to_join_a_job_that_trained_its_last_step_ends() -> None:
    """A replacement taken in as the job ends waits for peers that exported and exited: it ends too (its pod
    completes) instead of waiting out the plan timeout and then staying up as a parked node."""
    from torch._C._distributed_c10d import HashStore

    from resilientjob.agent.worker import JobFinished, await_peers, publish_plan, wait_for_plan_with

    store = HashStore()
    plan = _plan(3)
    publish_plan(store, plan, 0)
    store.set("committed", "99")
    assert not await_peers(store, plan, node=0, degree=1, timeout_s=0.1, steps=100)  # not yet the end
    store.set("committed", "100")
    started = time.monotonic()
    with pytest.raises(JobFinished):  # (a plan of its own: the call above checked in for generation 3)
        await_peers(store, _plan(4), node=0, degree=1, timeout_s=30, steps=100)
    with pytest.raises(JobFinished):
        wait_for_plan_with(store, 7, plan, timeout_s=30, steps=100)  # node 7: no plan takes it in
    assert time.monotonic() - started < 5
