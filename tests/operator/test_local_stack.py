"""`rjob local` end to end, the way a user runs it: `up`, `apply -f examples/local-cpu.yaml`, `get`, `logs`,
`chaos kill`, `chaos slow`, `down`, each a separate `rjob` process; the workers are real agent processes
started by the process kubelet, heartbeating and reporting iterations to the stack's real Redis, each serving
its metrics on a port of its own; the operator answers kopf's health endpoint as the chart's probes ask it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _rjob_stack import emulator_only
from _support import rjob_local, until

pytestmark = [
    pytest.mark.cluster,
    emulator_only("`rjob local` is the embedded stack: it starts its own emulator, Redis and kubelet"),
]


def rjob(state: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = rjob_local(state, *args, env={"RJOB_SYNTHETIC_TIME_SCALE": "0.02"})
    if check:
        assert done.returncode == 0, f"rjob local {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "local"
    up = rjob(state, "up")
    assert "API server http://" in up.stdout
    try:
        yield state
    finally:
        rjob(state, "down", check=False)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie waiting for its parent to reap it does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def job_row(table: str) -> list[str]:
    """The job's row of `rjob local get`, after its namespace (the example names none: `default`)."""
    row = next(line.split() for line in table.splitlines() if line.split()[1:2] == ["local-cpu"])
    assert row[0] == "default", table
    return row[1:]


def pod_rows(table: str) -> list[list[str]]:
    """The job's pods in `rjob local get`, each row after its namespace."""
    rows = [line.split() for line in table.splitlines()]
    return [row[1:] for row in rows if row[1:2] and row[1].startswith("local-cpu-node-")]


def metrics(port: int) -> bytes | None:
    """An agent's metrics page once it serves one: a pod is Running from its process's start, a moment
    before the agent listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            page = reply.read()
    except OSError:
        return None
    return page if b"rjob_agent_heartbeats_total" in page else None


def test_local_stack_up_apply_get_chaos_down(stack: Path) -> None:
    assert "resilientjob/local-cpu applied" in rjob(stack, "apply", "-f", "examples/local-cpu.yaml").stdout

    def running() -> str | None:
        table = rjob(stack, "get").stdout
        pods = pod_rows(table)
        healthy = len(pods) == 4 and all(row[1:] == ["Running", "0"] for row in pods)
        return table if healthy and job_row(table)[1] == "Running" else None

    until(running, 40, "4 running workers on generation 0")
    # The agents are real processes: they heartbeat and report iterations, so throughput gets measured.
    until(lambda: "x" if float(job_row(rjob(stack, "get").stdout)[-4]) > 0 else None, 20, "throughput")
    # Four agents on one host: the kubelet gave each its own metrics port, and each serves its metrics.
    ports = [int((stack / "pods" / f"local-cpu-node-{n}" / "metrics-port").read_text()) for n in range(4)]
    assert len(set(ports)) == 4
    for port in ports:
        until(lambda port=port: metrics(port), 20, f"an agent's metrics on port {port}")
    health_url = json.loads((stack / "state.json").read_text())["health_url"]
    with urllib.request.urlopen(health_url, timeout=5) as reply:
        assert reply.status == 200 and isinstance(json.loads(reply.read()), dict)
    # Forked from the stack's warm interpreter, which imported torch and the agent once for all of them.
    for n in range(4):
        pid = int((stack / "pods" / f"local-cpu-node-{n}" / "pid").read_text())
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert b"resilientjob.localstack._warm_start" in Path(f"/proc/{parent}/cmdline").read_bytes()
    missing = rjob(stack, "logs", "local-cpu-node-9", check=False)
    assert missing.returncode == 2 and "local-cpu-node-9" in missing.stderr
    state = json.loads((stack / "state.json").read_text())
    killed_pid = int((stack / "pods" / "local-cpu-node-2" / "pid").read_text())

    started = time.monotonic()
    assert "killed" in rjob(stack, "chaos", "kill", "local-cpu-node-2").stdout

    def replanned() -> str | None:
        table = rjob(stack, "get").stdout
        return table if int(job_row(table)[-1]) >= 1 else None

    table = until(replanned, 20, "generation 1 after the kill")
    assert time.monotonic() - started < 10
    # The killed worker is out of the layout (3/3), or already replaced by a pod under a new node id that
    # joined (4/4; `test_capacity_local`).
    assert job_row(table)[2] in ("3/3", "4/4")
    assert "local-cpu-node-2" not in [row[0] for row in pod_rows(table)]  # fenced: its pod is deleted
    until(lambda: "gone" if not alive(killed_pid) else None, 5, "the killed worker reaped")
    slow = rjob(stack, "chaos", "slow", "local-cpu-node-1", "--factor", "2", "--for", "5s")
    assert "slowed x2.0" in slow.stdout
    bad = rjob(stack, "chaos", "slow", "local-cpu-node-1", "--factor", "0.5", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "factor" in bad.stderr
    own = rjob(stack, "chaos", "slow", "local-cpu-node-1", "--link", "local-cpu-node-1", check=False)
    assert own.returncode == 2 and "is local-cpu-node-1's own node 1" in own.stderr, own.stderr
    # A duration of nothing would replace the live order with one already over (a clear in disguise).
    zero = rjob(stack, "chaos", "hang", "local-cpu-node-1", "--for", "0s", check=False)
    assert zero.returncode == 2 and "for: must be a positive duration" in zero.stderr, zero.stderr
    # Withdrawn before its time is up: the order is gone from the job's Redis, once.
    assert "pod/local-cpu-node-1 cleared" in rjob(stack, "chaos", "clear", "local-cpu-node-1").stdout
    assert "had no chaos order" in rjob(stack, "chaos", "clear", "local-cpu-node-1").stdout

    assert "stopped" in rjob(stack, "down").stdout
    assert not (stack / "state.json").exists()
    for pid in (state["pid"], state["operator_pid"]):
        until(lambda pid=pid: "gone" if not alive(pid) else None, 5, f"process {pid} stopped")
