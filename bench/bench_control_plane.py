"""Control-plane benchmark: fail-stop detection latency by path, decision latency, and operator CPU under
thousands of heartbeating agents. Everything is real: the operator process (kopf) against the emulated API
server over HTTP, a real redis-server, agents' messages written with the agents' own encoding.

    .venv/bin/python bench/bench_control_plane.py [--agents 4096] [--trials 5] [--load-seconds 30]

Parts:
1. Detection and decision latency on small jobs (4 nodes), `--trials` times per path:
   - pod path: a pod is deleted; time from the deletion to the operator's fence (its first action: it
     deletes the node's heartbeat key, which nothing else touches) and to generation g+1 committed in Redis;
   - heartbeat path: a node stops beating (TTL 2 s); time from its last beat to the fence and the commit.
   The planner's own time (`status.lastDecision.planningS`) is the decision latency.
2. Load: one job of `--agents` nodes; a load generator (a separate process) writes every agent's heartbeat
   (TTL 2 s) at 1 Hz and one iteration record per agent per second. For `--load-seconds` the operator's CPU
   is sampled from /proc; any heartbeat expiry it acts on is a missed beat. Then one agent stops beating:
   the time from its last beat to the operator's fence is the detection latency under load.
Comparison points (documented defaults, not measured here): torchrun notices a dead node after about 15 s,
TorchFT after about 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))
sys.path.insert(0, str(ROOT / "tests"))

from _rjob_stack import Operator, api_server, job_manifest, rjob_path  # noqa: E402
from _support import redis_server  # noqa: E402

from resilientjob.agent.telemetry import queue_beat  # noqa: E402
from resilientjob.operator._redis_state import JobRedis, node_list  # noqa: E402
from resilientjob.protocol.keys import JobKeys  # noqa: E402
from resilientjob.protocol.messages import Heartbeat, IterationRecord, decode, encode  # noqa: E402

PODS = "/api/v1/namespaces/default/pods"
TORCHRUN_S, TORCHFT_S = 15.0, 5.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


async def _status(emulator: Any, name: str) -> dict[str, Any]:
    response = await emulator.get(rjob_path(name))
    body = await response.json() if response.status == 200 else {}
    status: dict[str, Any] = body.get("status") or {}
    return status


async def _until(probe: Any, timeout: float, interval: float = 0.005) -> float:
    """Seconds (monotonic) at which `probe()` first returned truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await probe():
            return time.monotonic()
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s")


async def _pod_exists(emulator: Any, name: str) -> bool:
    response = await emulator.get(f"{PODS}/{name}")
    return bool(response.status == 200)


async def _generation(client: aioredis.Redis, keys: JobKeys) -> int:
    raw = await client.get(keys.plan)
    return int(json.loads(raw)["generation"]) if raw else -1


async def _beat(client: aioredis.Redis, keys: JobKeys, nodes: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        async with client.pipeline(transaction=False) as pipe:
            for node in nodes:
                pipe.set(keys.heartbeat(node), b"{}", px=2000)
            await pipe.execute()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def latency_trials(emulator: Any, redis_url: str, trials: int) -> dict[str, list[dict[str, float]]]:
    client = aioredis.Redis.from_url(redis_url)
    results: dict[str, list[dict[str, float]]] = {"pod": [], "heartbeat": []}
    try:
        for trial in range(trials):
            for path in ("pod", "heartbeat"):
                name = f"lat-{path[:2]}-{trial}"
                keys = JobKeys("default", name)
                await emulator.post(rjob_path(), json=job_manifest(name))
                await _until(lambda name=name: _generation_is(client, JobKeys("default", name), 0), 30)
                stop = asyncio.Event()
                beating = asyncio.create_task(_beat(client, keys, [0, 1, 2, 3], stop))
                await asyncio.sleep(1.2)  # the operator has seen every heartbeat
                if path == "pod":
                    # Node 2's heartbeat stays valid (60 s TTL) and nobody rewrites it: the only thing that
                    # removes it is the operator's fence, its first action on the deletion.
                    stop.set()
                    await beating
                    await client.set(keys.heartbeat(2), b"{}", px=60_000)
                    stop = asyncio.Event()
                    beating = asyncio.create_task(_beat(client, keys, [0, 1, 3], stop))
                    started = time.monotonic()
                    await emulator.delete(f"{PODS}/{name}-node-2")
                    fenced = await _until(lambda k=keys: _key_gone(client, k.heartbeat(2)), 10)
                else:
                    stop.set()
                    await beating
                    await client.set(keys.heartbeat(2), b"{}", px=2000)  # node 2's last beat
                    started = time.monotonic()
                    stop = asyncio.Event()
                    beating = asyncio.create_task(_beat(client, keys, [0, 1, 3], stop))
                if path == "heartbeat":
                    fenced = await _until(lambda n=name: _gone(emulator, f"{n}-node-2"), 10)
                committed = await _until(lambda k=keys: _generation_is(client, k, 1), 10)
                status = await _until_status(emulator, name)
                planning = float(status["lastDecision"]["planningS"])
                stop.set()
                await beating
                results[path].append(
                    {
                        "detect_s": fenced - started,
                        "commit_s": committed - started,
                        "planning_s": planning,
                    }
                )
                await emulator.delete(rjob_path(name))
    finally:
        await client.aclose()
    return results


async def _until_status(emulator: Any, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = await _status(emulator, name)
        if status.get("planGeneration") == 1:
            return status
        await asyncio.sleep(0.02)
    raise TimeoutError(f"{name}: status never reached generation 1")


async def _generation_is(client: aioredis.Redis, keys: JobKeys, generation: int) -> bool:
    return await _generation(client, keys) >= generation


async def _key_gone(client: aioredis.Redis, key: str) -> bool:
    return not await client.exists(key)


async def _gone(emulator: Any, pod: str) -> bool:
    return not await _pod_exists(emulator, pod)


# ---- load ------------------------------------------------------------------------------------------------
def load_generator(
    redis_url: str, job: str, agents: int, stop_node: int, stop_after_s: float, ready: Any, done: Any
) -> None:
    """Every agent: a heartbeat (TTL 2 s) and one iteration record per second; `stop_node` stops beating
    `stop_after_s` after the first round (its last beat's time goes to Redis for the parent)."""
    client = redis.Redis.from_url(redis_url)
    keys = JobKeys("default", job)
    step, last_beat = 0, 0.0
    late = 0
    stop_at = time.time() + stop_after_s
    while not done.is_set():
        tick = time.time()
        step += 1
        pipe = client.pipeline(transaction=False)
        for node in range(agents):
            if node == stop_node and tick >= stop_at:
                continue
            beat = Heartbeat(node=node, pod=f"{job}-node-{node}", generation=0, step=step, sent_at=tick)
            queue_beat(pipe, keys, node, encode(beat))
            record = IterationRecord(node=node, generation=0, step=step, seconds=1.0, samples=2, sent_at=tick)
            pipe.xadd(keys.iterations, {"m": encode(record)}, maxlen=10_000, approximate=True)
            if node == stop_node:
                last_beat = tick
        pipe.execute()
        ready.set()
        elapsed = time.time() - tick
        late += elapsed > 1.0
        time.sleep(max(0.0, 1.0 - elapsed))
    client.set(f"bench:{job}:late", late)
    client.set(f"bench:{job}:last_beat", last_beat)
    client.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


async def load_test(
    emulator: Any, redis_url: str, operator: Operator, agents: int, seconds: float
) -> dict[str, float]:
    job = "load"
    keys = JobKeys("default", job)
    client = aioredis.Redis.from_url(redis_url)
    manifest = job_manifest(
        job, nodes=agents, globalBatchSize=2 * agents, model="synthetic:llama2-7b", profile=None
    )
    created = time.monotonic()
    await emulator.post(rjob_path(), json=manifest)
    await _until(lambda: _generation_is(client, keys, 0), 300, 0.1)

    async def all_pods() -> bool:
        listing = await (await emulator.get(PODS)).json()
        count = sum(1 for p in listing["items"] if p["metadata"]["labels"].get("resilientjob.io/job") == job)
        return count == agents

    await _until(all_pods, 600, 0.5)
    setup_s = time.monotonic() - created
    stop_node = agents // 2
    context = multiprocessing.get_context("spawn")
    done, ready = context.Event(), context.Event()
    generator = context.Process(
        target=load_generator,
        args=(redis_url, job, agents, stop_node, 5 + seconds, ready, done),
        daemon=True,
    )
    generator.start()
    assert operator.process is not None
    pid = operator.process.pid
    await asyncio.to_thread(ready.wait, 120)
    await asyncio.sleep(5)  # every heartbeat seen once
    cpu0, wall0 = _cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    cpu1, wall1 = _cpu_seconds(pid), time.monotonic()
    missed_during_load = agents - len(await _live(client, keys, agents))
    generation_before = await _generation(client, keys)
    # The stopped agent's pod is fenced once the operator notices its heartbeat expired.
    fenced = await _until(lambda: _gone(emulator, f"{job}-node-{stop_node}"), 30, 0.01)
    done.set()
    generator.join(10)
    last_beat = float(await client.get(f"bench:{job}:last_beat") or 0.0)
    late = int(await client.get(f"bench:{job}:late") or 0)
    fenced_unix = time.time() - (time.monotonic() - fenced)
    await client.aclose()
    logged = _fence_logged_at(operator.log, job, stop_node)
    return {
        "agents": agents,
        "setup_s": setup_s,
        "cpu_cores": (cpu1 - cpu0) / (wall1 - wall0),
        "missed_heartbeats": float(missed_during_load + (generation_before > 0)),
        "generator_late_rounds": late,
        "detect_s": fenced_unix - last_beat,
        "detect_operator_log_s": logged - last_beat,
    }


def _fence_logged_at(log: Path, job: str, node: int) -> float:
    """Unix time of the operator's "fencing node N" log line (written when it decides, before the DELETE)."""
    import datetime

    marker = f"job default/{job}: fencing node {node} "
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if marker in line:
            stamp = datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return float("nan")


# ---- the operator's per-pass data path alone (no API server), new scan vs the old per-key pipeline --------
async def _old_pass(
    client: aioredis.Redis, keys: JobKeys, nodes: list[int], cursor: str
) -> tuple[set[int], str]:
    """What one pass cost before: a pipeline of one PTTL per node, and XREAD parsed by redis-py."""
    async with client.pipeline(transaction=False) as pipe:
        for node in nodes:
            pipe.pttl(keys.heartbeat(node))
        left = await pipe.execute()
    replies: Any = await client.xread({keys.iterations: cursor}, count=5000)
    for _, entries in replies:
        for entry_id, fields in entries:
            cursor = entry_id.decode()
            decode(IterationRecord, fields.get(b"m"), "bench")
    return {node for node, ms in zip(nodes, left, strict=True) if ms >= 0}, cursor


async def data_path(redis_url: str, agents: int, seconds: float, old: bool) -> dict[str, float]:
    """Passes every 0.25 s (the operator's poll interval) over `agents` beating at 1 Hz; one agent stops
    half-way. Returns this process's CPU in cores while passing, and the stopped agent's detection time."""
    job = f"path{agents}{'old' if old else 'new'}"
    keys = JobKeys("default", job)
    context = multiprocessing.get_context("spawn")
    done, ready = context.Event(), context.Event()
    stop_node = agents // 2
    generator = context.Process(
        target=load_generator, args=(redis_url, job, agents, stop_node, seconds / 2, ready, done), daemon=True
    )
    generator.start()
    await asyncio.to_thread(ready.wait, 60)
    client = aioredis.Redis.from_url(redis_url)
    state = JobRedis(client, keys)
    await state.new_iterations()  # start at the stream's end
    nodes = np.arange(agents, dtype=np.int64)
    arg = node_list(nodes.tolist())
    cursor = (await client.xrevrange(keys.iterations, count=1))[0][0].decode()
    detected = float("nan")
    passes = 0
    cpu0, wall0 = time.process_time(), time.monotonic()
    while time.monotonic() - wall0 < seconds:
        started = time.monotonic()
        if old:
            live, cursor = await _old_pass(client, keys, nodes.tolist(), cursor)
            silent = [n for n in nodes.tolist() if n not in live]
        else:
            scan = await state.scan(nodes, arg)
            await state.new_iterations()
            silent = scan.expired
        passes += 1
        if stop_node in silent and math.isnan(detected):
            detected = time.time()
        await asyncio.sleep(max(0.0, 0.25 - (time.monotonic() - started)))
    cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    done.set()
    generator.join(10)
    last_beat = float(await client.get(f"bench:{job}:last_beat") or 0.0)
    late = int(await client.get(f"bench:{job}:late") or 0)
    await client.aclose()
    return {
        "cpu_cores": cpu,
        "passes_per_s": passes / seconds,
        "detect_s": detected - last_beat,
        "generator_late_rounds": late,
    }


async def _live(client: aioredis.Redis, keys: JobKeys, agents: int) -> set[int]:
    async with client.pipeline(transaction=False) as pipe:
        for node in range(agents):
            pipe.exists(keys.heartbeat(node))
        flags = await pipe.execute()
    return {node for node, flag in enumerate(flags) if flag}


def _summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} s, max {max(values):.3f} s"


async def main(args: argparse.Namespace) -> None:
    if args.data_path:
        with redis_server() as redis_url:
            print(f"## operator data path per pass (4 passes/s), {args.load_seconds} s, one agent stops")
            print("agents | new: cores, detect s | old pipeline: cores, detect s | CPU ratio old/new")
            for agents in args.data_path:
                new = await data_path(redis_url, agents, args.load_seconds, old=False)
                old = await data_path(redis_url, agents, args.load_seconds, old=True)
                print(
                    f"{agents} | {new['cpu_cores']:.4f}, {new['detect_s']:.2f} "
                    f"(late rounds {new['generator_late_rounds']:.0f}, {new['passes_per_s']:.1f} passes/s) | "
                    f"{old['cpu_cores']:.4f}, {old['detect_s']:.2f} ({old['passes_per_s']:.1f} passes/s) | "
                    f"{old['cpu_cores'] / new['cpu_cores']:.1f}x"
                )
        return
    with redis_server() as redis_url:
        async with api_server() as (emulator, url):
            log = Path(args.log)
            operator = Operator(url, redis_url, log)
            operator.start()
            try:
                results = await latency_trials(emulator, redis_url, args.trials)
                print(f"## detection and decision latency ({args.trials} trials per path, 4-node jobs)")
                for path, rows in results.items():
                    detect = [r["detect_s"] for r in rows]
                    commit = [r["commit_s"] for r in rows]
                    planning = [r["planning_s"] for r in rows]
                    print(
                        f"{path:9} detect {_summary(detect)} | generation committed {_summary(commit)} | "
                        f"planner {_summary(planning)} | vs torchrun {TORCHRUN_S / max(commit):.1f}x, "
                        f"vs TorchFT {TORCHFT_S / max(commit):.1f}x faster (worst case)"
                    )
                if args.agents:
                    load = await load_test(emulator, redis_url, operator, args.agents, args.load_seconds)
                    print(
                        f"## load: {args.agents} agents, heartbeat + iteration at 1 Hz, {args.load_seconds} s"
                    )
                    for key, value in load.items():
                        print(f"{key:24} {value:.3f}")
                    print(
                        f"goals: cpu < 1 core: {load['cpu_cores'] < 1}; no heartbeat missed: "
                        f"{load['missed_heartbeats'] == 0}; detection < 3 s: {load['detect_s'] < 3}"
                    )
            finally:
                operator.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4096)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--load-seconds", type=float, default=30.0)
    parser.add_argument("--log", default="/tmp/rjob-bench-operator.log")
    parser.add_argument(
        "--data-path",
        type=int,
        nargs="*",
        help="measure only the operator's per-pass Redis path at these agent counts (no API server)",
    )
    asyncio.run(main(parser.parse_args()))
