"""A real 4-node GPT job in the local stack while its Redis dies and comes back empty (issue #14): the
workers train on through the outage (their rendezvous store is the store pod, not Redis), the operator
restores the plan from the durable record, fences nobody and reuses no generation, and every step still
processes exactly its own global batch."""

from __future__ import annotations

import os
import signal
import subprocess
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
"""Redis away this long: longer than a heartbeat TTL, so every key has expired when it is back."""


def _restart_empty(port: int, log: Path) -> subprocess.Popen[bytes]:
    """SIGKILL the redis-server on `port`, wait `GAP_S`, start an empty one on the same port."""
    info = redis.Redis(port=port).info("server")
    os.kill(int(info["process_id"]), signal.SIGKILL)
    time.sleep(GAP_S)
    with log.open("ab") as output:
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    until(lambda: _pings(port), 10, "the new redis-server")
    return server


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
    server = _restart_empty(client.connection_pool.connection_kwargs["port"], tmp_path / "redis.log")
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
        server.kill()
        server.wait()
