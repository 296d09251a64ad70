"""Bad manifests are refused: by the API server at admission (the CRD's schema and CEL rules, strict field
validation: an error naming the field; the local API server validates as a real one does), or by the
operator (a Valid=False condition naming the field and a Warning Event) for rules no schema states;
either way no pods."""

from __future__ import annotations

from typing import Any

import pytest
from _rjob_stack import Stack, eventually, job_manifest

pytestmark = pytest.mark.cluster

BAD = [
    ("no-nodes", {"nodes": None}, "spec.nodes"),
    ("f-too-big", {"faultTolerance": 4}, "spec.faultTolerance"),
    ("batch", {"globalBatchSize": 15, "microBatchSize": 2}, "spec.globalBatchSize"),
    ("policy", {"policy": "teleport"}, "spec.policy"),
    ("negative", {"microBatchSize": -1}, "spec.microBatchSize"),
    ("typo", {"nodez": 3}, "spec.nodez"),
    ("bf16-cpu", {"training": {"precision": "bf16"}}, "spec.training.precision"),
    ("encoder", {"model": "bert-large", "profile": None}, "spec.model"),
    ("no-path", {"data": {"format": "tokens"}}, "spec.data"),
    ("training-typo", {"training": {"lrr": 0.1}}, "spec.training.lrr"),
    ("memory-unit", {"deviceMemory": "80 GB"}, "spec.deviceMemory"),
]


async def test_bad_manifests_are_refused_naming_the_field_and_make_no_pods(stack: Stack) -> None:
    kube = stack.kube
    by_operator = []
    for name, change, field in BAD:
        error = await kube.create_job(job_manifest(name, **change))
        if error is None:
            by_operator.append((name, field))
        else:
            assert error.status in (400, 422) and field in str(error), (name, str(error))

    async def rejected(name: str) -> dict[str, Any] | None:
        status = await kube.job_status(name)
        return status if status.get("phase") == "Failed" else None

    for name, field in by_operator:
        status = await eventually(lambda name=name: rejected(name), 20, f"{name} rejected")
        valid = next(c for c in status["conditions"] if c["type"] == "Valid")
        assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
        assert valid["message"].startswith(field), valid["message"]
        ready = next(c for c in status["conditions"] if c["type"] == "WorkersReady")
        assert ready["reason"] == "InvalidSpec" and field in ready["message"], ready
    # Rules that no schema states reach the operator on any server; those the CRD states never do.
    assert {"bf16-cpu", "encoder"} <= {name for name, _ in by_operator}
    assert not {"f-too-big", "batch", "no-nodes", "policy", "typo", "memory-unit"} & {
        name for name, _ in by_operator
    }
    # A valid spec no layout can run (1 KiB per device for layers of 3 MiB): Planned=False naming the field.
    assert await kube.create_job(job_manifest("tiny-memory", deviceMemory="1Ki")) is None
    status = await eventually(lambda: rejected("tiny-memory"), 20, "tiny-memory failed")
    planned = next(c for c in status["conditions"] if c["type"] == "Planned")
    assert planned["status"] == "False" and planned["reason"] == "PlanInfeasible", planned
    assert planned["message"].startswith("spec.deviceMemory: the model does not fit"), planned["message"]

    async def warnings() -> list[dict[str, Any]] | None:
        found = [e for e in await kube.list("events") if e.get("reason") == "InvalidSpec"]
        return found if len(found) >= len(by_operator) else None

    events = await eventually(warnings, 10, "one InvalidSpec event per job the operator rejected")
    assert {e["involvedObject"]["name"] for e in events} >= {name for name, _ in by_operator}
    assert await kube.list("pods", "app.kubernetes.io/managed-by=resilientjob-operator") == []
