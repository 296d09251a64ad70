"""Test harness: a real redis-server on a free port, the emulated API server over real HTTP in the test's
event loop, and the real operator as a subprocess (so it can be SIGKILLed). With RJOB_KUBECONFIG set, the
same tests target that cluster instead of the emulator."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kmock
import redis.asyncio as aioredis

from resilientjob.operator import api
from resilientjob.operator.emulator import LocalApiServer

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def redis_server(password: str | None = None) -> Iterator[str]:
    """A throwaway redis-server; yields its URL (without the password)."""
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if password:
        command += ["--requirepass", password]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(5)


@contextlib.asynccontextmanager
async def api_server() -> AsyncIterator[tuple[LocalApiServer, str]]:
    async with LocalApiServer() as emulator, kmock.Server(emulator) as server:
        yield emulator, str(server.url).rstrip("/")


class Operator:
    """The operator as a child process."""

    def __init__(self, api_url: str, redis_url: str, log: Path) -> None:
        self.api_url, self.redis_url, self.log = api_url, redis_url, log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "RJOB_REDIS_URL": self.redis_url, "RJOB_STANDALONE": "1"}
        env["RJOB_API_URL" if not os.environ.get("RJOB_KUBECONFIG") else "RJOB_KUBECONFIG"] = (
            self.api_url if not os.environ.get("RJOB_KUBECONFIG") else os.environ["RJOB_KUBECONFIG"]
        )
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "resilientjob.cli", "operator", "--verbose"],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


async def eventually(probe: Callable[[], Awaitable[T | None]], timeout: float, what: str) -> T:
    """Poll `probe` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def job_manifest(name: str, **spec: Any) -> dict[str, Any]:
    body = {
        "image": "resilientjob/worker:test",
        "model": "uniform-8",
        "profile": {
            "inline": [
                {
                    "forwardS": 0.01,
                    "backwardS": 0.02,
                    "paramBytes": 2**20,
                    "optimizerBytes": 2**21,
                    "activationBytes": 2**18,
                }
            ]
            * 8
        },
        "nodes": 4,
        "globalBatchSize": 16,
        "microBatchSize": 1,
        "faultTolerance": 1,
    }
    body.update(spec)
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": "default"},
        "spec": {k: v for k, v in body.items() if v is not None},
    }


def rjob_path(name: str | None = None, status: bool = False) -> str:
    path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/default/{api.PLURAL}"
    if name:
        path += f"/{name}"
    return path + "/status" if status else path


async def redis_client(url: str, password: str | None = None) -> aioredis.Redis:
    client: aioredis.Redis = aioredis.Redis.from_url(url, password=password)
    return client
