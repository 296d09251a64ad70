"""Algorithm 1: escalation in overhead order at the ski-rental break-even, reset on recovery."""

from __future__ import annotations

import numpy as np
import pytest

from resilientjob.planner import PlannerError
from resilientjob.planner.failslow import (
    ChangeDetector,
    ChangeEvent,
    ChangeKind,
    Decision,
    MitigationController,
    MitigationCosts,
    RootCause,
    Strategy,
)

COSTS = MitigationCosts(microbatch_s=2.0, topology_s=10.0, replace_s=30.0)


def _slowdown(
    before: float = 1.0, after: float = 1.5, index: int = 100, detected_at: int = 104
) -> ChangeEvent:
    return ChangeEvent(index, ChangeKind.SLOWDOWN, before, after, detected_at)


def _run(controller: MitigationController, seconds: float, iterations: int) -> list[tuple[int, Decision]]:
    decisions = []
    for i in range(iterations):
        decision = controller.on_iteration(seconds)
        if decision is not None:
            decisions.append((i, decision))
    return decisions


def test_compute_fail_slow_escalates_s2_s3_s4_at_break_even() -> None:
    controller = MitigationController(COSTS)
    start = controller.on_change(_slowdown())
    assert start is not None and start.strategy is Strategy.IGNORE
    assert start.loss_s == pytest.approx(4 * 0.5)  # four slow iterations before the detecting one
    controller.localized((RootCause.COMPUTE,), nodes=(7,))
    decisions = _run(controller, 1.5, 200)
    assert [d.strategy for _, d in decisions] == [Strategy.MICROBATCH, Strategy.TOPOLOGY, Strategy.REPLACE]
    # Loss grows 0.5 s per iteration from 2 s: 10 s after 16 iterations, 30 s after 56.
    assert [i for i, _ in decisions] == [0, 15, 55]
    for _, decision in decisions:
        assert decision.loss_s >= decision.overhead_s
        assert decision.nodes == (7,)
    assert controller.applied == (Strategy.MICROBATCH, Strategy.TOPOLOGY, Strategy.REPLACE)


def test_communication_fail_slow_skips_microbatches() -> None:
    controller = MitigationController(COSTS)
    controller.on_change(_slowdown(detected_at=100))
    controller.localized((RootCause.COMMUNICATION,), nodes=(3, 4))
    decisions = _run(controller, 2.0, 100)
    assert [d.strategy for _, d in decisions] == [Strategy.TOPOLOGY, Strategy.REPLACE]
    assert decisions[-1][1].nodes == (3, 4)


def test_order_follows_the_configured_overheads() -> None:
    controller = MitigationController(MitigationCosts(microbatch_s=20.0, topology_s=5.0, replace_s=50.0))
    controller.on_change(_slowdown(detected_at=100))
    controller.localized((RootCause.COMPUTE,))
    assert controller.candidates() == [Strategy.TOPOLOGY, Strategy.MICROBATCH, Strategy.REPLACE]
    decisions = _run(controller, 2.0, 100)
    assert [d.strategy for _, d in decisions] == [Strategy.TOPOLOGY, Strategy.MICROBATCH, Strategy.REPLACE]


def test_recovery_resets_to_s1_and_a_new_episode_starts_from_scratch() -> None:
    controller = MitigationController(COSTS)
    controller.on_change(_slowdown())
    controller.localized((RootCause.COMPUTE,))
    assert [d.strategy for _, d in _run(controller, 1.5, 5)] == [Strategy.MICROBATCH]
    back = controller.on_change(ChangeEvent(150, ChangeKind.RECOVERY, 1.5, 1.0, 154))
    assert back is not None and back.strategy is Strategy.IGNORE
    assert not controller.active and controller.loss_s == 0.0
    assert controller.on_iteration(1.0) is None
    assert controller.on_change(ChangeEvent(160, ChangeKind.RECOVERY, 1.5, 1.0, 164)) is None
    again = controller.on_change(_slowdown(index=300, detected_at=300))
    assert again is not None and again.strategy is Strategy.IGNORE and controller.applied == ()


def test_short_fail_slow_is_only_rented() -> None:
    controller = MitigationController(COSTS)
    controller.on_change(_slowdown(after=1.1, detected_at=100))
    assert _run(controller, 1.1, 15) == []  # 1.6 s lost < 2 s for S2: S1 was the right call


def test_ladder_rung_keeps_the_episode_and_unknown_cause_allows_all() -> None:
    controller = MitigationController(COSTS)
    controller.on_change(_slowdown())
    assert controller.on_change(_slowdown(before=1.5, after=2.0, index=150, detected_at=154)) is None
    assert controller.candidates() == [Strategy.MICROBATCH, Strategy.TOPOLOGY, Strategy.REPLACE]
    with pytest.raises(PlannerError):
        MitigationController().localized((RootCause.COMPUTE,))
    with pytest.raises(PlannerError) as info:
        MitigationCosts(topology_s=-1.0)
    assert info.value.field == "topology_s"


def test_detector_drives_the_controller_end_to_end() -> None:
    values = np.random.default_rng(9).normal(1.0, 0.01, 600)
    values[100:400] *= 1.5
    detector, controller = ChangeDetector(), MitigationController(COSTS)
    applied = []
    for value in values:
        event = detector.feed(float(value))
        if event is not None:
            decision = controller.on_change(event)
            if decision and event.kind is ChangeKind.SLOWDOWN:
                controller.localized((RootCause.COMPUTE,), nodes=(2,))
            if decision:
                applied.append(decision.strategy)
        decision = controller.on_iteration(float(value))
        if decision:
            applied.append(decision.strategy)
    assert applied == [
        Strategy.IGNORE,
        Strategy.MICROBATCH,
        Strategy.TOPOLOGY,
        Strategy.REPLACE,
        Strategy.IGNORE,
    ]
    assert not controller.active
