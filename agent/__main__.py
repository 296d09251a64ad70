"""`python -m resilientjob.agent [--collective-timeout S] [--plan-timeout S] [--model-option K=V]`: the worker
pod's entry point. Reads its identity from the environment the operator puts in the pod (RJOB_JOB,
RJOB_NAMESPACE, RJOB_NODE, RJOB_JOB_UID, RJOB_REDIS_URL, RJOB_REDIS_PASSWORD, POD_NAME) and what to train from
RJOB_WORKLOAD (`protocol.workload`: model, data, training, output, checkpoints, device), and heartbeats to
Redis. A `synthetic:<profile>` model runs the synthetic loop that only follows the published plans (scale
tests of the control plane); every other model trains for real through `_bridge` (`protocol.models`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys

from prometheus_client import start_http_server
from redis.exceptions import RedisError

from resilientjob.protocol.keys import JobKeys

from ._redis import connect
from .telemetry import SUPERSEDED_EXIT, Superseded, Telemetry

FINISHED_TTL_S = 30.0
"""The last heartbeat of an agent whose training finished lives this long: until its pod shows Completed."""


async def main(argv: list[str]) -> int:
    env = os.environ
    try:
        job, namespace, node = env["RJOB_JOB"], env.get("RJOB_NAMESPACE", "default"), int(env["RJOB_NODE"])
        url = env["RJOB_REDIS_URL"]
        metrics_port = int(env.get("RJOB_AGENT_METRICS_PORT") or 0)
    except (KeyError, ValueError) as exc:
        print(f"resilientjob.agent: missing or bad environment: {exc}", file=sys.stderr)
        return 2
    if metrics_port:
        # Before the workload's imports (torch, seconds on a busy node): a pod reported Running answers
        # its scrape.
        start_http_server(metrics_port)
    # Imported only on its path: the synthetic agent must not pay for torch.
    from resilientjob.protocol.workload import WORKLOAD_ENV, load_workload

    from ._bridge import wants_training
    from .config import JobConfig

    try:
        workload = (
            load_workload(env[WORKLOAD_ENV])
            if env.get(WORKLOAD_ENV)
            # An agent started by hand may name only its model.
            else load_workload(json.dumps({"model": env.get("RJOB_MODEL", "")}))
        )
        real = wants_training(workload.model)
        config = JobConfig.from_argv(argv, workload) if real else None
    except ValueError as exc:
        print(f"resilientjob.agent: {exc}", file=sys.stderr)
        return 2
    client = connect(url, env.get("RJOB_REDIS_PASSWORD"))
    telemetry = Telemetry(
        client,
        JobKeys(namespace, job),
        node,
        env.get("POD_NAME", f"{job}-node-{node}"),
        job_uid=env.get("RJOB_JOB_UID", ""),
    )
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    if config is not None:
        from ._bridge import preload

        preload()
    heartbeat = asyncio.create_task(telemetry.heartbeat_forever(stopped))
    code = 1
    try:
        if config is not None:
            from ._bridge import train

            code = await train(telemetry, stopped, config)
        else:
            from .synthetic import train as synthetic_train

            await synthetic_train(telemetry, stopped, float(env.get("RJOB_SYNTHETIC_TIME_SCALE", "0.05")))
            code = 0
    except (ValueError, TimeoutError) as exc:
        print(f"resilientjob.agent: {exc}", file=sys.stderr)
        code = 2
    finally:
        # Ended on its own (not stopped by a signal): training finished.
        finished = code == 0 and not stopped.is_set()
        stopped.set()
        await heartbeat
        if finished:
            # The process still has to exit and the kubelet to report the pod Completed, which on a loaded
            # node takes longer than a heartbeat's TTL; a lapse meanwhile would be fenced as a failure.
            with contextlib.suppress(RedisError, OSError, Superseded):
                await telemetry.beat(ttl_s=FINISHED_TTL_S)
        with contextlib.suppress(Exception):
            await client.aclose()
    # A deleted job's agent (the keys are another job's now) says so in its exit code too.
    return SUPERSEDED_EXIT if telemetry.superseded else code


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
