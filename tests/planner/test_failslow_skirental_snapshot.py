"""The ski-rental controller's episode survives a process boundary: `snapshot` then `resume` in a fresh
controller continues at the same strategy with the same accumulated loss; malformed snapshots are refused."""

from __future__ import annotations

import json

import pytest

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.failslow import (
    ChangeEvent,
    ChangeKind,
    MitigationController,
    MitigationCosts,
    RootCause,
)


def _slowed(costs: MitigationCosts) -> MitigationController:
    controller = MitigationController(costs)
    controller.on_change(
        ChangeEvent(index=10, kind=ChangeKind.SLOWDOWN, before_s=1.0, after_s=1.5, detected_at=12)
    )
    controller.localized((RootCause.COMPUTE,), (3,))
    return controller


def test_a_resumed_controller_decides_exactly_as_the_original() -> None:
    costs = MitigationCosts(microbatch_s=2.0, topology_s=20.0, replace_s=200.0)
    original = _slowed(costs)
    decisions = []
    for _ in range(5):  # some loss accumulates, maybe a first decision
        decisions.append(original.on_iteration(1.5))
    snapshot = original.snapshot()
    assert snapshot is not None
    copy = MitigationController(costs)
    copy.resume(json.loads(json.dumps(snapshot)))  # through JSON, as the operator stores it
    assert copy.active and copy.loss_s == pytest.approx(original.loss_s)
    assert copy.applied == original.applied
    for _ in range(400):
        assert copy.on_iteration(1.5) == original.on_iteration(1.5)
    assert copy.applied == original.applied and len(original.applied) >= 2


def test_healthy_controller_has_no_snapshot_and_bad_ones_are_refused() -> None:
    controller = MitigationController()
    assert controller.snapshot() is None
    controller.resume(None)
    assert not controller.active
    with pytest.raises(PlannerError, match="snapshot"):
        controller.resume(
            {"healthy_s": 1.0, "causes": ["no-such-cause"], "nodes": [], "loss_s": 0, "applied": []}
        )
    with pytest.raises(PlannerError, match="snapshot"):
        controller.resume({"healthy_s": 1.0})
