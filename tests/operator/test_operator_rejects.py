"""Bad manifests are rejected with a condition naming the field, a Warning Event, and no pods."""

from __future__ import annotations

from typing import Any

import pytest
from _rjob_stack import eventually, job_manifest, rjob_path

pytestmark = pytest.mark.cluster

BAD = [
    ("no-nodes", {"nodes": None}, "spec.nodes"),
    ("f-too-big", {"faultTolerance": 4}, "spec.faultTolerance"),
    ("batch", {"globalBatchSize": 15, "microBatchSize": 2}, "spec.globalBatchSize"),
    ("policy", {"policy": "teleport"}, "spec.policy"),
    ("negative", {"microBatchSize": -1}, "spec.microBatchSize"),
    ("typo", {"nodez": 3}, "spec.nodez"),
]


async def test_bad_manifests_get_a_condition_an_event_and_no_pods(cluster: Any) -> None:
    emulator, _, _ = cluster
    for name, change, _ in BAD:
        await emulator.post(rjob_path(), json=job_manifest(name, **change))

    async def rejected(name: str) -> dict[str, Any] | None:
        response = await emulator.get(rjob_path(name))
        status = (await response.json()).get("status") or {}
        return status if status.get("phase") == "Failed" else None

    for name, _, field in BAD:
        status = await eventually(lambda name=name: rejected(name), 20, f"{name} rejected")
        valid = next(c for c in status["conditions"] if c["type"] == "Valid")
        assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
        assert valid["message"].startswith(field), valid["message"]
    pods = await (await emulator.get("/api/v1/namespaces/default/pods")).json()
    assert pods["items"] == []

    async def warnings() -> list[dict[str, Any]] | None:
        events = (await (await emulator.get("/api/v1/namespaces/default/events")).json())["items"]
        found = [e for e in events if e.get("reason") == "InvalidSpec"]
        return found if len(found) == len(BAD) else None

    events = await eventually(warnings, 10, "one InvalidSpec event per bad job")
    assert {e["involvedObject"]["name"] for e in events} == {name for name, _, _ in BAD}
