"""A real 4-node GPT job in the local stack while its Redis dies and the stack starts it again, empty
(issue #14): the workers train on through the outage (their rendezvous store is the store pod, not Redis),
the operator restores the plan from the durable record, fences nobody and reuses no generation, and every
step still processes exactly its own global batch."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis
from _bridge_jobs import apply_demo_job
from _support import job_object, until

from resilientjob.agent.data import SampleOrder
from resilientjob.protocol.messages import PlanAnnouncement
from resilientjob.protocol.store_keys import samples_key, trained_samples

ROOT = Path(__file__).resolve().parents[2]
GAP_S = 3.0
"""Redis away at least this long: longer than a heartbeat TTL, so every key has expired when it is back."""


def _kill_and_wait_for_the_restart(port: int, stack: Path) -> float:
    """SIGKILL the stack's redis-server; the stack starts an empty one on the same port, as a cluster
    restarts a crashed Redis pod (`localstack.stack.RESTART_DELAY_S` later). The seconds Redis was away."""
    info = redis.Redis(port=port).info("server")
    os.kill(int(info["process_id"]), signal.SIGKILL)
    killed = time.monotonic()
    until(lambda: not _pings(port), 10, "the killed redis-server gone")
    until(lambda: _pings(port), 30, "the redis-server the stack started again")
    state = json.loads((stack / "state.json").read_text())
    assert state["restarts"]["redis-server"] == 1 and state["redis_pid"] != int(info["process_id"])
    assert "redis-server exited" in (stack / "stack.log").read_text()
    return time.monotonic() - killed


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port).ping())
    except redis.ConnectionError:
        return False


@pytest.mark.torch
@pytest.mark.cluster
@pytest.mark.slow
def test_redis_restarted_empty_while_real_workers_train(stack: Path, tmp_path: Path) -> None:
    manifest, client, keys, store = apply_demo_job(stack, tmp_path, "outage")

    def committed() -> int:
        return int(store.add("committed", 0))

    def published() -> PlanAnnouncement | None:
        raw = client.get(keys.plan)
        return PlanAnnouncement.model_validate_json(raw) if raw else None

    until(lambda: committed() >= 15, 60, "15 committed steps on 4 workers")
    before = published()
    assert before is not None
    pids = {n: int((stack / "pods" / f"outage-node-{n}" / "pid").read_text()) for n in range(4)}
    away_s = _kill_and_wait_for_the_restart(client.connection_pool.connection_kwargs["port"], stack)
    assert away_s >= GAP_S
    try:
        at_restart = committed()
        # The operator puts the plan back from the durable record, under the same generation.
        restored = until(published, 30, "the plan key restored")
        assert restored.generation == before.generation and restored.layout == before.layout
        until(lambda: committed() >= at_restart + 30, 90, "30 steps after Redis came back")
        # Nobody was fenced for the silence: same pods, same processes, no newer generation.
        time.sleep(3.0)  # a wrongly counted silence would be fenced by now (grace, TTL, a pass)
        after = published()
        assert after is not None and after.generation == before.generation
        assert {n: int((stack / "pods" / f"outage-node-{n}" / "pid").read_text()) for n in range(4)} == pids
        status = job_object(stack, "outage")["status"]
        assert status["phase"] == "Running" and status.get("fencedNodes", []) == [], status
        assert status["planGeneration"] == before.generation, status
        end = committed()
        spec = manifest["spec"]
        order = SampleOrder(spec["data"]["numSamples"], spec["globalBatchSize"], seed=0)

        for step in range(end):
            # Each sample of the step's global batch exactly once, through the outage (every worker records
            # its ids before it votes: a counted step's record is whole).
            ids = trained_samples(store.get(samples_key(step)).decode())
            assert sorted(ids) == sorted(order.step_ids(step)), f"step {step}"
        logs = "".join((stack / "pods" / f"outage-node-{n}" / "log").read_text() for n in range(4))
        assert "Traceback" not in logs
    finally:
        client.close()
