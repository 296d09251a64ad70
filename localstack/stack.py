"""The local stack behind `rjob local up`: the emulated API server (real HTTP), a real redis-server, the
real operator process and the process kubelet, supervised by one background process that writes where
everything is to `<state>/state.json` and stops it all on SIGTERM (`rjob local down`); killed outright, it
takes its children with it (`_tether`). `rjob local up` starts it as `python -m resilientjob.localstack
<state>`.

A redis-server or operator that exits is started again, as a cluster restarts a crashed pod of a Deployment:
after RESTART_DELAY_S, doubling for each exit in a row up to RESTART_DELAY_MAX_S (an exit after
RESTART_RESET_S of running starts the count again). Redis comes back on the same port and empty, as a Redis
pod without persistence does; the operator rebuilds it from the job's durable record. `state.json` and
`stack.log` say what was restarted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import kmock
import kopf

from resilientjob.operator.kube import KubeApi

from ._tether import tethered
from ._warm_start import AGENT_WARM_START, WARM_SERVER_ENV
from .emulator import LocalApiServer
from .kubelet import ProcessKubelet
from .ports import free_port

__all__ = ["free_port", "serve"]

logger = logging.getLogger(__name__)

COLD_START_ENV = "RJOB_LOCAL_COLD_START"
"""Set to 1: every pod's interpreter starts afresh (no warm start: `_warm_start`)."""
RESTART_DELAY_S = 5.0
"""The wait before a crashed component is started again: longer than a heartbeat's TTL, so a Redis restart
comes back with every key expired, as a rescheduled Redis pod does."""
RESTART_DELAY_MAX_S = 60.0
RESTART_RESET_S = 60.0
"""A component that ran this long before it exited starts its backoff over."""


@dataclass(slots=True)
class _Supervised:
    """One restartable child of the stack: how to start it, and its restarts so far."""

    name: str
    start: Callable[[], subprocess.Popen[bytes]]
    process: subprocess.Popen[bytes]
    restarts: int = 0
    crashes_in_a_row: int = 0
    started_at: float = field(default_factory=time.monotonic)

    def backoff_s(self) -> float:
        doubled: float = RESTART_DELAY_S * 2 ** max(self.crashes_in_a_row - 1, 0)
        return min(doubled, RESTART_DELAY_MAX_S)


async def _keep_running(child: _Supervised, stopped: asyncio.Event, on_restart: Callable[[], None]) -> None:
    """Start `child` again each time it exits (its backoff first), until `stopped`. Says so on standard
    output: `stack.log` under `rjob local up`, each line dated (`__main__`)."""
    while not stopped.is_set():
        code = child.process.poll()
        if code is not None:
            ran_s = time.monotonic() - child.started_at
            child.crashes_in_a_row = 1 if ran_s >= RESTART_RESET_S else child.crashes_in_a_row + 1
            wait = child.backoff_s()
            logger.warning("%s exited with code %s; starting it again in %.0f s", child.name, code, wait)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), wait)
            if stopped.is_set():
                return
            try:
                process = child.start()
            except OSError as exc:  # counted as one more crash: tried again after a longer wait
                logger.warning("%s could not be started again: %s", child.name, exc)
                child.started_at = time.monotonic()
                continue
            child.process, child.started_at = process, time.monotonic()
            child.restarts += 1
            logger.warning("%s started again (pid %d)", child.name, child.process.pid)
            on_restart()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), 0.5)


def _wait_for_port(port: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s}s")


async def serve(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    redis_port = free_port()

    def start_redis() -> subprocess.Popen[bytes]:
        command = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""]
        with (state_dir / "redis.log").open("ab") as log:
            # A restart needs the same port back (every client has its URL); another process could have
            # bound it meanwhile (rare: see .ports): redis-server then exits at once, and is tried again
            # after its backoff.
            return subprocess.Popen(
                tethered([*command, "--appendonly", "no"]), stdout=log, stderr=subprocess.STDOUT
            )

    redis = _Supervised("redis-server", start_redis, start_redis())
    operator: _Supervised | None = None
    try:
        _wait_for_port(redis_port)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        async with LocalApiServer(pod_logs=state_dir / "pods") as emulator, kmock.Server(emulator) as server:
            api_url = str(server.url).rstrip("/")
            kubeconfig = write_kubeconfig(state_dir / "kubeconfig", api_url)
            health_port = free_port()
            env = {
                **os.environ,
                "RJOB_API_URL": api_url,
                "RJOB_REDIS_URL": redis_url,
                "RJOB_STANDALONE": "1",
                "RJOB_HEALTH_PORT": str(health_port),
            }

            def start_operator() -> subprocess.Popen[bytes]:
                with (state_dir / "operator.log").open("ab") as log:
                    return subprocess.Popen(
                        tethered([sys.executable, "-m", "resilientjob.cli", "operator"]),
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )

            operator = supervised = _Supervised("operator", start_operator, start_operator())
            kube = KubeApi(kopf.ConnectionInfo(server=api_url, insecure=True))
            # Pods' programs fork from one interpreter that imported torch and the agent once (`_warm_start`);
            # RJOB_LOCAL_COLD_START=1 starts each pod's interpreter afresh, as a node does.
            cold = os.environ.get(COLD_START_ENV, "") not in ("", "0")
            kubelet = ProcessKubelet(
                kube,
                state_dir,
                warm_start=None if cold else AGENT_WARM_START,
                warm_server=os.environ.get(WARM_SERVER_ENV) or None,
            )
            base = {
                "api_url": api_url,
                "redis_url": redis_url,
                "pid": os.getpid(),
                # kopf's liveness endpoint, as the chart's probes ask it in a cluster.
                "health_url": f"http://127.0.0.1:{health_port}/healthz",
                # For kubectl and any client that reads a kubeconfig (`rjob local kubeconfig` prints it).
                "kubeconfig": str(kubeconfig),
            }
            children = [redis, operator]

            def write_state() -> None:
                state = {
                    **base,
                    "operator_pid": supervised.process.pid,
                    "redis_pid": redis.process.pid,
                    "restarts": {child.name: child.restarts for child in children},
                }
                temporary = state_dir / ".state.json.tmp"
                temporary.write_text(json.dumps(state))
                os.replace(temporary, state_dir / "state.json")  # readers never see half of it

            write_state()
            supervisor = asyncio.gather(
                *(_keep_running(child, stopped, write_state) for child in children), return_exceptions=True
            )
            try:
                await kubelet.run(stopped, before_stop=lambda: _stop(supervised.process))
            finally:
                stopped.set()
                await supervisor
                await kube.close()
                await emulator.close_streams()
    finally:
        # The operator stops first, while the API server is still up: it must not replan around workers
        # that are only being shut down, nor spin on a vanished API server.
        _stop(operator.process if operator is not None else None)
        _stop(redis.process)
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "state.json").unlink()


def write_kubeconfig(path: Path, api_url: str) -> Path:
    """A kubeconfig naming the local API server (plain HTTP, no credentials), its context current."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "rjob-local", "cluster": {"server": api_url}}],
        "users": [{"name": "rjob-local", "user": {}}],
        "contexts": [
            {
                "name": "rjob-local",
                "context": {"cluster": "rjob-local", "user": "rjob-local", "namespace": "default"},
            }
        ],
        "current-context": "rjob-local",
    }
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)
    return path


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
