"""A world that stops with every node alive, with the real training runtime, the way a user sees it: `rjob
local up`, the demo's GPT on three workers, then

- `rjob local chaos break`: one worker's next collective fails, as a reset connection would. Every worker
  abandons the step and waits, alive. The operator re-forms the world (`CollectiveFailed`, the same layout
  as the next generation) and training goes on at the abandoned step: no node fenced, no step repeated.
- `rjob local chaos hang`: one worker blocks in its next collective while its agent beats on. Its peers
  abort; it neither aborts nor steps. The operator fences it as hung (`NodeHung`) and the others train on.

Before `operator/_aborts`, both left the workers waiting out their plan timeout (120 s), after which every
pod exited and the job lost every node at once."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from _rjob_stack import emulator_only
from _support import job_object, pod_log, rjob_ok, until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.serial,  # a world is re-formed within a bound
    pytest.mark.cluster,
    pytest.mark.slow,
    emulator_only("`rjob local` is the embedded stack: it starts its own emulator, Redis and kubelet"),
]


def _status(state: Path) -> dict[str, Any]:
    status: dict[str, Any] = job_object(state, "demo-gpt").get("status") or {}
    return status


def _events(state: Path) -> list[dict[str, Any]]:
    api_url = json.loads((state / "state.json").read_text())["api_url"]
    with urllib.request.urlopen(f"{api_url}/api/v1/namespaces/default/events", timeout=10) as reply:
        items: list[dict[str, Any]] = json.loads(reply.read())["items"]
    return items


def _recovery(state: Path, trigger: str) -> dict[str, Any] | None:
    rows = [r for r in _status(state).get("recoveries") or [] if r["trigger"] == trigger]
    return rows[-1] if rows else None


def _steps_after(state: Path, pod: str, generation: int) -> list[int]:
    log = pod_log(state, pod)
    return [int(m.group(1)) for m in re.finditer(rf"^step (\d+) gen {generation} ", log, re.MULTILINE)]


def test_a_broken_collective_re_forms_the_world_and_a_hung_worker_is_fenced(
    local: Path, tmp_path: Path
) -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    manifest["spec"]["nodes"] = 3
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    rjob_ok(local, "apply", "-f", str(path))
    until(lambda: _status(local).get("step", 0) > 30, 120, "30 steps of the 3-worker job")
    layout = _status(local)["layout"]

    ordered_at = time.monotonic()
    rjob_ok(local, "chaos", "break", "demo-gpt-node-1")
    reformed = until(lambda: _recovery(local, "CollectiveFailed"), 40, "the world re-formed")
    took_s = time.monotonic() - ordered_at
    # The grace (3 s) and the commit: well inside the 120 s the workers used to wait before every pod exited.
    assert took_s < 30, took_s
    assert reformed["nodes"] == [] and reformed["layout"] == layout, reformed
    # The peers waiting for the broken rank's part abandoned the step at the rank's word (its generation's
    # `abandoned` counter), none by waiting out its 5 s collective timeout ("no progress within").
    broken = reformed["generation"] - 1
    for node in range(3):
        said = [
            line
            for line in rjob_ok(local, "logs", f"demo-gpt-node-{node}").splitlines()
            if line.startswith(f"gen {broken}: ") and " abandoned" in line
        ]
        assert said and "no progress within" not in said[0], (node, said)
    assert not reformed.get("planS") and not _status(local)["lastDecision"].get("candidates")  # no planner
    generation = reformed["generation"]
    status = _status(local)
    assert not status.get("fencedNodes"), status.get("fencedNodes")
    decision = status["lastDecision"]
    # Which node aborts first depends on where the break lands (the broken call itself, or a peer's
    # collective timing out first); every node of the world did.
    assert "nodes [0, 1, 2] abandoned step" in decision["reason"], decision
    # Training goes on at the abandoned step, every node in: no committed step trained twice.
    until(lambda: len(_steps_after(local, "demo-gpt-node-0", generation)) > 10, 60, "steps after re-forming")
    log = rjob_ok(local, "logs", "demo-gpt-node-0")
    steps = [int(m.group(1)) for m in re.finditer(r"^step (\d+) gen \d+ ", log, re.MULTILINE)]
    assert steps == sorted(set(steps)), "a committed step was trained again"
    assert "abandoned: " in log and "waiting for the next generation" in log
    measured = until(
        lambda: (r := _recovery(local, "CollectiveFailed")) and "copiedBytes" in r and r,
        30,
        "the switch measured",
    )
    assert measured["copiedBytes"] == 0, measured  # every node kept its layers
    # One Event for the re-formation, a Warning naming the generation (a Normal one repeated it before).
    told = [e for e in _events(local) if e.get("reason") == "CollectiveFailed"]
    assert [e["type"] for e in told] == ["Warning"], told
    assert told[0]["message"].endswith(f"(generation {generation})"), told[0]["message"]
    assert _status(local)["workers"] == "3/3"

    # A reset in the middle of a switch: node 0's next rendezvous breaks, and node 1's next collective
    # brings that switch on. Every node abandons it alive; the world re-forms again instead of waiting
    # out the workers' plan timeout (120 s), as it did before the agents reported failed switches.
    rjob_ok(local, "chaos", "break", "demo-gpt-node-0", "--switch")
    time.sleep(0.5)  # two polls of node 0's chaos watcher: the order is armed before the switch comes
    ordered_at = time.monotonic()
    rjob_ok(local, "chaos", "break", "demo-gpt-node-1")

    def switch_re_formed() -> dict[str, Any] | None:
        row = _recovery(local, "CollectiveFailed")
        decision = _status(local)["lastDecision"]
        switched = (
            row and row["generation"] >= generation + 2 and "abandoned the switch" in decision["reason"]
        )
        return decision if switched else None

    decision = until(switch_re_formed, 60, "the world re-formed after its switch broke")
    took_s = time.monotonic() - ordered_at
    assert took_s < 30, took_s  # two re-formations: the second in a row waits the full grace (3 s)
    assert "nodes [0, 1, 2] abandoned the switch to generation" in decision["reason"], decision
    # Node 0's own line names the broken call; its peers, told by its abandon notice, may report first.
    said = [
        line for line in rjob_ok(local, "logs", "demo-gpt-node-0").splitlines() if "switch abandoned" in line
    ]
    assert said and "broken on order" in said[0], said
    generation = decision["generation"]
    until(lambda: len(_steps_after(local, "demo-gpt-node-0", generation)) > 10, 60, "steps after the switch")
    assert not _status(local).get("fencedNodes") and _status(local)["workers"] == "3/3"

    ordered_at = time.monotonic()
    rjob_ok(local, "chaos", "hang", "demo-gpt-node-2", "--for", "5m")
    hung = until(lambda: _recovery(local, "NodeHung"), 90, "the hung worker fenced")
    took_s = time.monotonic() - ordered_at
    assert took_s < 60, took_s  # 5 s until the peers abort, then two collective timeouts and the grace
    assert hung["nodes"] == [2], hung
    # Detected from when its peers began to wait on it: a collective timeout, then the hang window.
    assert hung["detectS"] >= 13, hung
    assert hung["generation"] > generation
    until(
        lambda: len(_steps_after(local, "demo-gpt-node-0", hung["generation"])) > 10,
        60,
        "the others training on without the hung worker",
    )
    status = _status(local)
    assert status["workers"] == "2/2" and 2 in status["failedNodes"], status  # the demo replaces nobody
