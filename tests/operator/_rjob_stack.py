"""Test harness: a real redis-server on a free port, a Kubernetes API server, and the real operator as a
subprocess (so it can be SIGKILLed).

The API server is kmock's emulator over real HTTP in the test's event loop, or, with RJOB_KUBECONFIG set,
the cluster of that kubeconfig (for example the kind cluster of deploy/kind/). Tests reach either through
the same client, `Kube` (the operator's own `KubeApi` over HTTP), so every test runs unchanged against
both; the few that need the emulator say so with `emulator_only(reason)`. In the cluster mode the
operator runs here with the kubeconfig, watching only RJOB_TEST_NAMESPACE (default `default`); the worker
pods it creates use an image that is never pulled, so they stay Pending and the tests drive heartbeats and
telemetry through the local Redis, exactly as on the emulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kmock
import kopf
import pytest
import redis.asyncio as aioredis
import yaml
from _support import child_env, operator_starter

from resilientjob.localstack._warm_start import WarmProcess
from resilientjob.localstack.emulator import LocalApiServer
from resilientjob.operator import api
from resilientjob.operator.crd import CRD_FILE
from resilientjob.operator.kube import KubeApi, KubeError
from resilientjob.protocol.keys import JobKeys

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

KUBECONFIG = os.environ.get("RJOB_KUBECONFIG", "")
"""Set: the tests run against this kubeconfig's cluster; unset: against the emulator."""
REAL_CLUSTER = bool(KUBECONFIG)
NAMESPACE = os.environ.get("RJOB_TEST_NAMESPACE", "default") if REAL_CLUSTER else "default"


def emulator_only(reason: str) -> pytest.MarkDecorator:
    """For a test that cannot run on a real cluster; `reason` says why (shown when it is skipped)."""
    return pytest.mark.skipif(REAL_CLUSTER, reason=f"emulator only: {reason}")


real_cluster_only = pytest.mark.skipif(
    not REAL_CLUSTER, reason="needs a real cluster: set RJOB_KUBECONFIG (see deploy/kind/)"
)


def connection_from_kubeconfig(path: str) -> kopf.ConnectionInfo:
    """The cluster of a kubeconfig, read the way the operator reads it (kopf's kubeconfig login)."""
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = path
    try:
        info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    finally:
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
    if info is None:
        raise RuntimeError(f"no cluster in kubeconfig {path}")
    return info


class Kube:
    """The tests' Kubernetes client: HTTP to the emulator or to a real cluster, the same calls for both."""

    def __init__(self, info: kopf.ConnectionInfo, namespace: str = NAMESPACE) -> None:
        self.api = KubeApi(info, timeout_s=30.0)
        self.namespace = namespace

    async def close(self) -> None:
        await self.api.close()

    def path(self, plural: str, name: str | None = None, status: bool = False) -> str:
        """`pods`, `events`, ... or `resilientjobs` in the test namespace."""
        if plural == api.PLURAL:
            base = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{self.namespace}/{plural}"
        else:
            base = f"/api/v1/namespaces/{self.namespace}/{plural}"
        path = f"{base}/{name}" if name else base
        return path + "/status" if status else path

    async def get(self, plural: str, name: str) -> dict[str, Any] | None:
        return await self.api.get(self.path(plural, name))

    async def list(self, plural: str, label_selector: str = "") -> list[dict[str, Any]]:
        return await self.api.list(self.path(plural), label_selector)

    async def delete(self, plural: str, name: str) -> bool:
        return await self.api.delete(self.path(plural, name))

    async def create_job(self, manifest: dict[str, Any]) -> KubeError | None:
        """Create a ResilientJob; the API error when the server refuses it (a real server validates the
        CRD schema, strictly: unknown fields are errors, not silently pruned)."""
        manifest = {**manifest, "metadata": {**manifest["metadata"], "namespace": self.namespace}}
        try:
            await self.api._request(
                "POST", self.path(api.PLURAL), body=manifest, params={"fieldValidation": "Strict"}
            )
        except KubeError as error:
            return error
        return None

    async def job_status(self, name: str) -> dict[str, Any]:
        status: dict[str, Any] = ((await self.get(api.PLURAL, name)) or {}).get("status") or {}
        return status

    async def job_pods(self, job: str) -> list[dict[str, Any]]:
        """The job's worker pods (not its store pod) that are not being deleted (a real API server keeps them
        a moment longer)."""
        return [
            pod
            for pod in await self.list("pods", f"resilientjob.io/job={job}")
            if not pod["metadata"].get("deletionTimestamp")
            and "resilientjob.io/node" in (pod["metadata"].get("labels") or {})
        ]

    async def events_of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in await self.list("events") if (e.get("involvedObject") or {}).get("name") == name]

    async def install_crd(self) -> None:
        """Apply the committed CRD (a real cluster may not have it yet) and wait until it is served."""
        crd = yaml.safe_load((ROOT / CRD_FILE).read_text())
        path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        await self.api.create(path, crd)
        name = crd["metadata"]["name"]

        async def established() -> bool:
            body = await self.api.get(f"{path}/{name}") or {}
            conditions = (body.get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

        await eventually(established, 30, f"CRD {name} established")

    async def delete_jobs(self, timeout: float = 60) -> None:
        """Delete every ResilientJob of the namespace and wait until they are gone (the operator must still
        run: it removes its finalizer)."""
        for job in await self.list(api.PLURAL):
            await self.delete(api.PLURAL, job["metadata"]["name"])

        async def gone() -> bool:
            return not await self.list(api.PLURAL)

        await eventually(gone, timeout, "test jobs deleted")


@contextlib.asynccontextmanager
async def api_server(**options: Any) -> AsyncIterator[tuple[LocalApiServer, str]]:
    async with LocalApiServer(**options) as emulator, kmock.Server(emulator) as server:
        yield emulator, str(server.url).rstrip("/")


def kubeconfig_for(url: str, path: Path) -> Path:
    """A kubeconfig naming a plain-HTTP API server (the emulator): the cluster mode's login, testable here."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {}}],
        "contexts": [
            {"name": "local", "context": {"cluster": "local", "user": "tester", "namespace": "default"}}
        ],
        "current-context": "local",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class Operator:
    """The operator as a child process: against `api_url` (the emulator), or with `kubeconfig` (a cluster,
    then watching only `namespace`). It forks from the suite's warm interpreter for operators, which runs it
    as `python -m` would (`_support.operator_starter`), or else is a fresh interpreter."""

    def __init__(
        self,
        api_url: str | None,
        redis_url: str,
        log: Path,
        *,
        kubeconfig: str | None = None,
        namespace: str | None = None,
        verbose: bool = True,
    ) -> None:
        if (api_url is None) == (kubeconfig is None):
            raise ValueError("give exactly one of api_url and kubeconfig")
        self.api_url, self.redis_url, self.log = api_url, redis_url, log
        self.kubeconfig, self.namespace, self.verbose = kubeconfig, namespace, verbose
        self.process: subprocess.Popen[bytes] | WarmProcess | None = None

    def start(self) -> None:
        env = {**child_env(), "RJOB_REDIS_URL": self.redis_url, "RJOB_STANDALONE": "1"}
        for variable in ("RJOB_API_URL", "RJOB_KUBECONFIG", "RJOB_NAMESPACE"):
            env.pop(variable, None)
        if self.api_url is not None:
            env["RJOB_API_URL"] = self.api_url
        if self.kubeconfig is not None:
            env["RJOB_KUBECONFIG"] = self.kubeconfig
        if self.namespace:
            env["RJOB_NAMESPACE"] = self.namespace
        command = [sys.executable, "-m", "resilientjob.cli", "operator", *(["--verbose"] * self.verbose)]
        with self.log.open("ab") as sink:
            self.process = operator_starter().start(command, env, sink.fileno(), cwd=str(ROOT))
            if self.process is None:
                self.process = subprocess.Popen(
                    command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT
                )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass(frozen=True, slots=True)
class Stack:
    """What a control-plane test works with (the `stack` fixture)."""

    kube: Kube
    redis_url: str
    operator: Operator

    def keys(self, job: str) -> JobKeys:
        return JobKeys(NAMESPACE, job)


@contextlib.asynccontextmanager
async def heartbeats(
    client: aioredis.Redis, keys: JobKeys, nodes: list[int], every_s: float
) -> AsyncIterator[None]:
    """Beat for `nodes` every `every_s` seconds, with the agents' 2 s TTL, while the block runs.

    The beating stops on an event, never on a cancel: on Python 3.11 a redis-py command can swallow a cancel
    (CPython gh-86296), and a loop that missed its cancel would hold the test's event loop open."""
    stop = asyncio.Event()

    async def beat() -> None:
        while not stop.is_set():
            for node in nodes:
                await client.set(keys.heartbeat(node), b"{}", px=2000)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    beating = asyncio.create_task(beat())
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait({beating}, timeout=5)


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
        "model": "synthetic:uniform-8",
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
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {k: v for k, v in body.items() if v is not None},
    }


def rjob_path(name: str | None = None, status: bool = False) -> str:
    path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NAMESPACE}/{api.PLURAL}"
    if name:
        path += f"/{name}"
    return path + "/status" if status else path


async def redis_client(url: str, password: str | None = None) -> aioredis.Redis:
    client: aioredis.Redis = aioredis.Redis.from_url(url, password=password)
    return client


async def set_pod_phase(kube: Kube, pod: str, phase: str) -> None:
    """Set a pod's phase (and Ready) as a kubelet would: for tests that play the kubelet."""
    ready = "True" if phase == "Running" else "False"
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}
    if phase == "Failed":
        status["reason"] = "Error"
    await kube.api.patch(kube.path("pods", pod, status=True), {"status": status})
