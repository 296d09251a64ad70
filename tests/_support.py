"""Helpers shared by the tests: a throwaway real redis-server on a free port, polling with a deadline, and
`rjob local` run as a user runs it.

Importable from every test folder because `tests/conftest.py` puts this folder on `sys.path`."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from resilientjob.localstack._warm_start import (
    AGENT_WARM_START,
    WARM_SERVER_ENV,
    WarmServer,
    WarmStart,
    WarmStarter,
)

# Every test takes its ports from here (why: that module's docstring).
from resilientjob.localstack.kubelet import pod_base_env
from resilientjob.localstack.ports import free_port

T = TypeVar("T")


OPERATOR_WARM_START = WarmStart(
    preload=("kopf", "resilientjob.cli", "resilientjob.cli._operator", "resilientjob.operator.handlers"),
    programs=("resilientjob.cli",),
)
"""The suite starts an operator for most of its tests, and each spent two CPU seconds importing kopf and the
operator: they fork from one interpreter that imported them once (`localstack._warm_start`, as the local
stack's pods do), where the suite's environment allows (else they start cold)."""


def child_env() -> dict[str, str]:
    """This process's environment for the programs the tests start, less PYTEST_CURRENT_TEST: pytest sets it
    afresh for each test and phase, and a child whose environment differs from the session's warm
    interpreters' (started by an earlier test) starts cold. No program of ours reads it."""
    return {key: value for key, value in os.environ.items() if key != "PYTEST_CURRENT_TEST"}


_SESSION_STARTERS: list[WarmStarter] = []
"""Warm starters made once for the whole session (their interpreters serve until it ends)."""
_SESSION_SERVERS: list[WarmServer] = []


def _session_log(name: str) -> Path:
    """A session-wide server's log, removed at exit when it stayed empty (it says why pods started cold)."""
    log = Path(tempfile.gettempdir()) / f"rjob-tests-{os.getpid()}-{name}.log"

    def remove_if_empty() -> None:
        if log.exists() and not log.stat().st_size:
            log.unlink()

    atexit.register(remove_if_empty)  # registered first: runs after the server is closed
    return log


def operator_starter() -> WarmStarter:
    """The session's warm starts for operators (`_rjob_stack.Operator`)."""
    if not _SESSION_STARTERS:
        starter = WarmStarter(OPERATOR_WARM_START, _session_log("operators"))
        _SESSION_STARTERS.append(starter)
        atexit.register(starter.close)
    return _SESSION_STARTERS[0]


def pods_warm_server() -> str:
    """The socket of the session's warm interpreter for the local stacks' pods (`rjob local up` tells its
    stack through WARM_SERVER_ENV): each stack's pods fork from it, and the stacks do not import torch and
    the agent again, each while its first pods wait."""
    if not _SESSION_SERVERS:
        path = Path(tempfile.gettempdir()) / f"rjob-tests-{os.getpid()}-pods.sock"
        # What the stacks' pods start from (their kubelet's env), as a stack's own warm interpreter has.
        server = WarmServer(AGENT_WARM_START, path, _session_log("pods"), pod_base_env(child_env()))
        _SESSION_SERVERS.append(server)
        atexit.register(server.close)
    return str(_SESSION_SERVERS[0].path)


def session_servers() -> set[int]:
    """Processes started once to serve the rest of the session (not a test's leftovers)."""
    pids = {starter.pid for starter in _SESSION_STARTERS if starter.pid is not None}
    return pids | {server.process.pid for server in _SESSION_SERVERS}


class RedisProcess:
    """A real redis-server on loopback that a test may kill and start again on the same port (empty: no
    persistence), as a Redis blip or a failover does to the agents and the operator."""

    def __init__(self, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its URL (without the password)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no"]
        if self.password:
            command += ["--requirepass", self.password]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        address = ("127.0.0.1", self.port)
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(address, timeout=0.2):
                return
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, as the issue's blip did: no goodbye to the clients."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(5)
            self.process = None


@contextlib.contextmanager
def redis_server(password: str | None = None) -> Iterator[str]:
    """A throwaway redis-server on loopback; yields its URL (without the password)."""
    server = RedisProcess(password)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def until(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


ROOT = Path(__file__).resolve().parents[1]


def rjob_local(
    state: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`rjob local ARGS` in a subprocess with its state under `state` (RJOB_LOCAL_DIR); never raises on a
    failed command: the caller asserts or raises with the output."""
    # The stack `up` starts forks its pods from the session's warm interpreter (`pods_warm_server`).
    warm = {WARM_SERVER_ENV: pods_warm_server()} if args[:1] == ("up",) else {}
    return subprocess.run(
        [sys.executable, "-m", "resilientjob.cli", "local", *args],
        env={**child_env(), **warm, **(env or {}), "RJOB_LOCAL_DIR": str(state)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def rjob_ok(state: Path, *args: str) -> str:
    """`rjob local ARGS` that must succeed; its standard output."""
    done = rjob_local(state, *args)
    assert done.returncode == 0, f"rjob local {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


def pod_log(state: Path, pod: str, namespace: str = "default") -> str:
    """A pod's log as the local stack under `state` serves it (`GET pods/NAME/log`): for polling, where
    `rjob local logs` would start an interpreter (half a second of CPU) five times a second beside the
    training it waits for."""
    api_url = json.loads((state / "state.json").read_text())["api_url"]
    url = f"{api_url}/api/v1/namespaces/{namespace}/pods/{pod}/log"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text: str = reply.read().decode(errors="replace")
    return text


def job_object(state: Path, name: str, namespace: str = "default") -> dict[str, Any]:
    """The ResilientJob `name` as the local stack under `state` serves it (a plain GET, with its status)."""
    api_url = json.loads((state / "state.json").read_text())["api_url"]
    path = f"/apis/resilientjob.io/v1alpha1/namespaces/{namespace}/resilientjobs/{name}"
    with urllib.request.urlopen(api_url + path, timeout=10) as reply:
        body: dict[str, Any] = json.loads(reply.read())
    return body


def bert_spec_fields(**fields: Any) -> dict[str, Any]:
    """The spec fields of a small planning job (synthetic BERT-large, 4 nodes, batch 16, f = 1), with
    `fields` over them: for tests that plan, not train."""
    return {
        "image": "rjob:test",
        "model": "synthetic:bert-large",
        "nodes": 4,
        "globalBatchSize": 16,
        "microBatchSize": 1,
        "faultTolerance": 1,
        **fields,
    }
