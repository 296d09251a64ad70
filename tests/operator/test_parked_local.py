"""A node that fail-slow mitigation S4 parks comes back when it recovers, with the real training runtime, the
way a user sees it: `rjob local up`, apply the demo's GPT on four workers with S4 priced low, slow worker 3
with `rjob local chaos slow` for a while. The operator parks it (the job runs DP3 without it); its agent
probes its device meanwhile (`agent._parked`) and reports the recovery once the order ends; the operator
restores the four-worker plan, and a new worker on node 3 joins it and trains."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from _rjob_stack import emulator_only
from _support import job_object, rjob_local, rjob_ok, until

ROOT = Path(__file__).resolve().parents[2]
SLOWED_S = 40
"""How long worker 3 is slowed: S2, then S4, must come while the order holds (on two loaded cores the
levels and the ladder take 10-20 s)."""

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    emulator_only("`rjob local` is the embedded stack: it starts its own emulator, Redis and kubelet"),
]


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Path]:
    """`rjob local up` under a fresh state folder; `down` after the test."""
    state = tmp_path / "local"
    rjob_ok(state, "up")
    try:
        yield state
    finally:
        rjob_local(state, "down")


def _status(state: Path) -> dict[str, Any]:
    status: dict[str, Any] = job_object(state, "demo-gpt").get("status") or {}
    return status


def test_a_parked_worker_recovers_and_trains_again(local: Path, tmp_path: Path) -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    manifest["spec"]["nodes"] = 4  # DP4: the job is faster with node 3 than without it
    # S4 right after S2: parking is what this test is about.
    manifest["spec"]["failSlow"]["overheads"] = {"microbatchS": 1, "topologyS": 30, "restartS": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    rjob_ok(local, "apply", "-f", str(path))
    until(lambda: _status(local).get("step", 0) > 50, 120, "50 steps of the 4-worker job")
    assert _status(local)["layout"] == "DP4 PP[1,1,1,1]"

    ordered_at = time.time()
    rjob_ok(local, "chaos", "slow", "demo-gpt-node-3", "--factor", "4", "--for", f"{SLOWED_S}s")
    parked = until(lambda: (s := _status(local)).get("parkedNodes") == [3] and s, SLOWED_S, "node 3 parked")
    parked_generation = parked["planGeneration"]
    assert parked["layout"] == "DP3 PP[1,1,1]"

    def restored() -> dict[str, Any] | None:
        """The first generation after the parking that took node 3 back on its recovery, once the job's
        status shows its layout with no node parked."""
        status = _status(local)
        back = [
            r
            for r in status.get("recoveries") or []
            if r["generation"] > parked_generation and r["trigger"] == "NodeRecovered" and 3 in r["nodes"]
        ]
        whole = not status.get("parkedNodes") and status["layout"] == "DP4 PP[1,1,1,1]"
        return back[0] if back and whole else None

    back = until(restored, SLOWED_S + 60, "node 3's recovery and the four-worker plan back")
    generation = back["generation"]
    # Back once the order has ended, not before: the probe measures the device, not the host's load.
    at = datetime.strptime(back["at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    assert at >= ordered_at + SLOWED_S - 1, (at - ordered_at, back)

    def trains_again() -> list[int] | None:
        log = rjob_ok(local, "logs", "demo-gpt-node-3")
        steps = [int(m.group(1)) for m in re.finditer(rf"^step (\d+) gen {generation} ", log, re.MULTILINE)]
        return (
            steps
            if "probing its device" in log and "takes this node back" in log and len(steps) > 5
            else None
        )

    until(trains_again, 60, f"node 3's new worker training in generation {generation}")
    assert _status(local)["workers"] == "4/4"
