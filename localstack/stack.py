"""The local stack behind `rjob local up`: the emulated API server (real HTTP), a real redis-server, the
real operator process and the process kubelet, supervised by one background process that writes where
everything is to `<state>/state.json` and stops it all on SIGTERM (`rjob local down`); killed outright, it
takes its children with it (`_tether`). `rjob local up` starts it as `python -m resilientjob.localstack
<state>`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import kmock
import kopf

from resilientjob.operator.kube import KubeApi

from ._tether import tethered
from .emulator import LocalApiServer
from .kubelet import ProcessKubelet, free_port

__all__ = ["free_port", "serve"]


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
    redis = subprocess.Popen(
        tethered(
            [
                "redis-server",
                "--port",
                str(redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ]
        ),
        stdout=(state_dir / "redis.log").open("ab"),
        stderr=subprocess.STDOUT,
    )
    operator: subprocess.Popen[bytes] | None = None
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
            operator = subprocess.Popen(
                tethered([sys.executable, "-m", "resilientjob.cli", "operator"]),
                env=env,
                stdout=(state_dir / "operator.log").open("ab"),
                stderr=subprocess.STDOUT,
            )
            kube = KubeApi(kopf.ConnectionInfo(server=api_url, insecure=True))
            kubelet = ProcessKubelet(kube, state_dir)
            state = {
                "api_url": api_url,
                "redis_url": redis_url,
                "pid": os.getpid(),
                "operator_pid": operator.pid,
                # kopf's liveness endpoint, as the chart's probes ask it in a cluster.
                "health_url": f"http://127.0.0.1:{health_port}/healthz",
                # For kubectl and any client that reads a kubeconfig (`rjob local kubeconfig` prints it).
                "kubeconfig": str(kubeconfig),
            }
            (state_dir / "state.json").write_text(json.dumps(state))
            try:
                await kubelet.run(stopped, before_stop=lambda: _stop(operator))
            finally:
                await kube.close()
                await emulator.close_streams()
    finally:
        # The operator stops first, while the API server is still up: it must not replan around workers
        # that are only being shut down, nor spin on a vanished API server.
        _stop(operator)
        _stop(redis)
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
