"""`python -m resilientjob.agent`: the worker pod's entry point. Reads its identity from the environment the
operator puts in the pod (RJOB_JOB, RJOB_NAMESPACE, RJOB_NODE, RJOB_REDIS_URL, RJOB_REDIS_PASSWORD, POD_NAME),
heartbeats to Redis and runs the synthetic training loop that follows the published plan."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

from prometheus_client import start_http_server

from ._redis import JobKeys, connect
from .synthetic import train
from .telemetry import Telemetry


async def main() -> int:
    env = os.environ
    try:
        job, namespace, node = env["RJOB_JOB"], env.get("RJOB_NAMESPACE", "default"), int(env["RJOB_NODE"])
        url = env["RJOB_REDIS_URL"]
    except (KeyError, ValueError) as exc:
        print(f"resilientjob.agent: missing or bad environment: {exc}", file=sys.stderr)
        return 2
    if env.get("RJOB_AGENT_METRICS_PORT"):
        start_http_server(int(env["RJOB_AGENT_METRICS_PORT"]))
    client = connect(url, env.get("RJOB_REDIS_PASSWORD"))
    telemetry = Telemetry(client, JobKeys(namespace, job), node, env.get("POD_NAME", f"{job}-node-{node}"))
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    scale = float(env.get("RJOB_SYNTHETIC_TIME_SCALE", "0.05"))
    try:
        await asyncio.gather(telemetry.heartbeat_forever(stopped), train(telemetry, stopped, scale))
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
