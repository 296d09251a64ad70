"""Capacity comes back in the local stack, the way a user sees it: `rjob local up`, apply the local job,
kill two workers with `rjob local chaos kill`; the operator plans around them, asks for two pods under new
node ids, the process kubelet runs them as real agent processes, and they join through the planner: the
layout grows back to four workers, every generation is newer than the one before, and training goes on."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from _rjob_stack import emulator_only
from _support import job_object, rjob_local, until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    emulator_only("`rjob local` is the embedded stack: it starts its own emulator, Redis and kubelet"),
]


def rjob(state: Path, *args: str) -> str:
    done: subprocess.CompletedProcess[str] = rjob_local(
        state, *args, env={"RJOB_SYNTHETIC_TIME_SCALE": "0.02"}
    )
    assert done.returncode == 0, f"rjob local {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "local"
    rjob(state, "up")
    try:
        yield state
    finally:
        rjob_local(state, "down")


def _job(state: Path) -> dict[str, Any]:
    return job_object(state, "local-cpu")


def _pods(table: str) -> dict[int, str]:
    """Worker pods of `rjob local get`: node id -> phase."""
    rows = [line.split()[1:] for line in table.splitlines()]  # after the namespace column
    pods = [row for row in rows if row and row[0].startswith("local-cpu-node-")]
    return {int(row[0].rsplit("-", 1)[1]): row[1] for row in pods}


def test_two_killed_workers_come_back_as_new_nodes_and_the_layout_grows_again(
    stack: Path, tmp_path: Path
) -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "local-cpu.yaml").read_text())
    # A noisy shared CPU must not add fail-slow generations here: every generation is a kill or a join.
    manifest["spec"]["failSlow"] = {"enabled": False}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    rjob(stack, "apply", "-f", str(path))

    def running(nodes: set[int]) -> str | None:
        table = rjob(stack, "get")
        pods = _pods(table)
        return table if set(pods) == nodes and set(pods.values()) == {"Running"} else None

    until(lambda: running({0, 1, 2, 3}), 60, "4 running workers")
    until(lambda: _job(stack)["status"].get("step", 0) > 0, 30, "steps on generation 0")
    before = _job(stack)["status"]
    assert before["planGeneration"] == 0 and before["workersTotal"] == 4

    assert "killed" in rjob(stack, "chaos", "kill", "local-cpu-node-1")
    assert "killed" in rjob(stack, "chaos", "kill", "local-cpu-node-2")

    # Their places: two new pods under ids never used before, run by the kubelet.
    until(lambda: running({0, 3, 4, 5}), 40, "workers 0, 3 and the replacements 4, 5 running")

    def grown() -> dict[str, Any] | None:
        status: dict[str, Any] = _job(stack)["status"]
        joined = {n for r in status["recoveries"] if r["trigger"] == "NodeJoined" for n in r["nodes"]}
        return status if joined >= {4, 5} and status.get("workers") == "4/4" else None

    status = until(grown, 30, "nodes 4 and 5 joined: four workers again")
    recoveries = status["recoveries"]
    generations = [r["generation"] for r in recoveries]
    assert generations == list(range(1, len(generations) + 1)), recoveries  # strictly increasing, no gaps
    failed = {n for r in recoveries if r["trigger"] in ("NodeFailed", "HeartbeatExpired") for n in r["nodes"]}
    assert failed == {1, 2}, recoveries
    assert sorted(status["failedNodes"]) == [1, 2]
    assert status["capacity"]["nextNodeId"] == 6 and status["capacity"]["replaced"] == 2
    assert {c["type"]: c["status"] for c in status["conditions"]}["Degraded"] == "False"
    # The published plan runs on the survivors and the new nodes; what the new nodes lack is copied to
    # them from surviving replicas.
    published = json.loads(_configmap(stack)["data"]["plan.json"])
    nodes = {s["node"] for p in published["plan"]["pipelines"] for s in p["stages"] if not s["rerouted_to"]}
    assert nodes == {0, 3, 4, 5}
    joined_last = status["lastDecision"]
    if joined_last["trigger"] == "NodeJoined":
        transfers = published["plan"]["transfers"]
        for node in joined_last["nodes"]:
            # A new node starts with nothing: every layer of its stages comes from a peer that holds it.
            held = {
                layer
                for p in published["plan"]["pipelines"]
                for s in p["stages"]
                if s["node"] == node and not s["rerouted_to"]
                for layer in range(*s["layers"])
            }
            copied = {t["layer"] for t in transfers if t["dst"] == node and t["src"] != node}
            assert held and held <= copied, (node, held, transfers)
    until(lambda: _events(stack).count("NodeReplaced") == 2, 5, "an Event for each replacement")

    # Training goes on under the grown layout.
    step = status["step"]
    until(lambda: _job(stack)["status"]["step"] > step, 20, "steps after the layout grew")
    assert _job(stack)["status"]["planGeneration"] == generations[-1]


def _configmap(state: Path) -> dict[str, Any]:
    api_url = json.loads((state / "state.json").read_text())["api_url"]
    with urllib.request.urlopen(
        api_url + "/api/v1/namespaces/default/configmaps/local-cpu-plan", timeout=10
    ) as reply:
        body: dict[str, Any] = json.loads(reply.read())
    return body


def _events(state: Path) -> list[str]:
    api_url = json.loads((state / "state.json").read_text())["api_url"]
    with urllib.request.urlopen(api_url + "/api/v1/namespaces/default/events", timeout=10) as reply:
        items = json.loads(reply.read())["items"]
    return [e.get("reason", "") for e in items if (e.get("involvedObject") or {}).get("name") == "local-cpu"]
