"""A parked slow node whose recovery report does not come is judged by its probe against the training nodes'
own timings of it (`_failslow_parked`), through the tracker as the telemetry pass drives it."""

from __future__ import annotations

import json

import pytest
from test_failslow_decisions import feed, record, slow_report

from resilientjob.operator._failslow import Action, FailSlowTracker, FindingKind, Mitigation
from resilientjob.operator._failslow_parked import AGREE, FORGET, LONGEST, PROBES, ParkedRecheck
from resilientjob.operator.api import FailSlowSpec, StrategyOverheads
from resilientjob.protocol.messages import IterationRecord

PLAN_WITHOUT_1 = frozenset({0, 2, 3})


def _parked_episode() -> FailSlowTracker:
    """Node 1 x4, its episode open, then parked by S4 in generation 1 (the plan runs 0, 2, 3). Threshold
    1.5, as the demo's: a parked node is back within 1.25x."""
    overheads = StrategyOverheads(microbatch_s=60.0, topology_s=60.0, restart_s=0.5)
    tracker = FailSlowTracker(FailSlowSpec(overheads=overheads, min_duration_s=0, slowdown_threshold=1.5))
    tracker.gate.new_generation(0, {})
    feed(tracker, range(15), {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1})
    feed(tracker, range(15, 21), {0: 0.1, 1: 0.4, 2: 0.1, 3: 0.1})
    tracker.report(slow_report(1, step=20, slowdown=4.0), now=0.0)
    tracker.tick(now=0.0)
    decision = tracker.iteration(record(1, 21, 0.4))
    assert decision is not None and decision.action is Action.REPLACE, decision
    tracker.published(decision, 1)
    tracker.gate.new_generation(1, {0: 1.0, 2: 1.0, 3: 1.0})
    tracker.drain_findings()
    return tracker


def _probe(node: int, step: int, seconds: float) -> IterationRecord:
    return IterationRecord(
        node=node, generation=1, step=step, seconds=seconds, samples=0, sent_at=0.0, compute_s=seconds
    )


def _reference(node: int, step: int, probe_s: float) -> IterationRecord:
    return IterationRecord(
        node=node, generation=1, step=step, seconds=0.1, samples=4, sent_at=0.0, probe_s=probe_s
    )


def _steps(tracker: FailSlowTracker, parked_probe_s: float, references: dict[int, float], step: int) -> None:
    """What a telemetry pass hands the tracker: the training nodes' references, a window of the parked
    node's probes."""
    for node, seconds in references.items():
        tracker.probe_step(_reference(node, step, seconds), in_plan=True)
    for offset in range(PROBES):
        tracker.probe_step(_probe(1, step + offset, parked_probe_s), in_plan=False)


def _passes(tracker: FailSlowTracker, probes_s: list[float], now: float) -> list[Mitigation | None]:
    """One pass per window of probes at `probes_s[i]`, at `now` (the wait being over)."""
    out = []
    for index, seconds in enumerate(probes_s):
        _steps(tracker, seconds, {}, step=100 + PROBES * index)
        out.append(tracker.parked_recheck(PLAN_WITHOUT_1, now=now))
    return out


def test_a_parked_node_that_recovered_before_its_probe_had_a_level_is_taken_back_on_its_probe() -> None:
    tracker = _parked_episode()
    first = tracker.spec.parked_recheck_s
    # Its probe reads what the training nodes' do (5 ms): its slowdown ended before the probe's first level,
    # so its agent's detector sees no fall and sends nothing. Not judged before the wait is over.
    assert tracker.parked_recheck(PLAN_WITHOUT_1, now=100.0) is None  # parked at 100 s (first seen)
    _steps(tracker, 5.1e-3, {0: 5.0e-3, 2: 4.9e-3, 3: 5.2e-3}, step=30)
    assert tracker.parked_recheck(PLAN_WITHOUT_1, now=100.0 + first - 1) is None
    assert tracker.active and tracker.slow == {1: 4.0}
    # Then window by window: back on the AGREE-th in a row within the bar, not before.
    decisions = [tracker.parked_recheck(PLAN_WITHOUT_1, now=100.0 + first)]  # the window fed above
    decisions += _passes(tracker, [5.1e-3] * (AGREE - 1), now=100.0 + first)
    assert decisions[:-1] == [None] * (AGREE - 1)
    restore = decisions[-1]
    assert restore is not None and restore.action is Action.RESTORE and not tracker.active
    (back,) = [f for f in tracker.drain_findings() if f.kind is FindingKind.RECOVERED]
    assert back.nodes == (1,)
    said = f"parked {first:.0f}s with no recovery report, its probe reads 1.02x the median of 3"
    assert said in back.message and f"{AGREE} windows in a row" in back.message, back.message
    assert tracker.parked.trips[1][0] == 1


def test_one_window_over_the_bar_starts_the_count_over() -> None:
    tracker = _parked_episode()
    tracker.parked_recheck(PLAN_WITHOUT_1, now=0.0)
    tracker.probe_step(_reference(0, 30, 5.0e-3), in_plan=True)
    first = tracker.spec.parked_recheck_s
    # A node still slowed just over the threshold, whose windows read around the bar on a loaded host.
    readings = [1.2, 1.2, 1.31, 1.2, 1.2] + [1.2] * (AGREE - 2)
    decisions = _passes(tracker, [5.0e-3 * r for r in readings], now=first)
    assert decisions[:-1] == [None] * (len(readings) - 1)
    assert decisions[-1] is not None  # AGREE in a row only after the 1.31x window


def test_a_parked_node_whose_probe_still_reads_slow_stays_parked_and_is_said_once() -> None:
    tracker = _parked_episode()
    first = tracker.spec.parked_recheck_s
    tracker.parked_recheck(PLAN_WITHOUT_1, now=0.0)
    _steps(tracker, 19.5e-3, {0: 5.0e-3, 2: 4.9e-3, 3: 5.2e-3}, step=30)
    assert tracker.parked_recheck(PLAN_WITHOUT_1, now=first) is None
    assert _passes(tracker, [19.5e-3] * 4, now=first + 1) == [None] * 4
    (still,) = [f for f in tracker.drain_findings() if f.kind is FindingKind.SLOW_DEVICE]
    assert still.nodes == (1,) and "its probe reads 3.90x the median" in still.message, still.message
    assert tracker.active and tracker.slow == {1: 4.0}
    # Out of the parked set for a while (a pass that saw it in the plan) and parked again: said again.
    tracker.parked_recheck(frozenset({0, 1, 2, 3}), now=first + 2)
    tracker.parked_recheck(PLAN_WITHOUT_1, now=first + 2)
    assert _passes(tracker, [19.5e-3], now=2 * first + 2) == [None]
    assert [f.nodes for f in tracker.drain_findings() if f.kind is FindingKind.SLOW_DEVICE] == [(1,)]
    # Its order ends: the probe falls to the others' level and it is back AGREE windows later.
    decisions = _passes(tracker, [5.0e-3] * AGREE, now=2 * first + 3)
    assert decisions[-1] is not None and decisions[-1].action is Action.RESTORE


def test_the_parked_check_reads_against_healthy_training_nodes_only() -> None:
    tracker = _parked_episode()
    first = tracker.spec.parked_recheck_s
    tracker.parked_recheck(PLAN_WITHOUT_1, now=0.0)
    assert _passes(tracker, [5e-3] * AGREE, now=first) == [None] * AGREE  # no reference yet
    # The parked node's own (earlier) reference is no reference for it: with it the median would be 2.75 ms,
    # and the node would read 1.8x.
    tracker.probe_step(_reference(1, 29, 0.5e-3), in_plan=True)
    tracker.probe_step(_reference(0, 30, 5e-3), in_plan=True)
    assert _passes(tracker, [5e-3] * AGREE, now=first)[-1] is not None


def test_references_leave_out_slow_nodes_and_nodes_out_of_the_plan() -> None:
    recheck = ParkedRecheck(10.0)
    for node, seconds in {0: 1.0, 2: 10.0, 4: 20.0, 5: 30.0}.items():
        recheck.reference(node, seconds)
    recheck.due([3], now=0.0)
    for _ in range(PROBES):
        recheck.probe(3, 1.1)
    reading = recheck.judge(3, 1.25, slow={2}, among={0, 2, 4})
    assert reading is not None and reading.references == 2 and reading.reference_s == 10.5  # 0 and 4
    for _ in range(PROBES):
        recheck.probe(3, 1.1)
    reading = recheck.judge(3, 1.25, slow={2}, among={0, 2})
    assert reading is not None and reading.references == 1 and reading.ratio == pytest.approx(1.1)


def test_a_record_without_a_probe_and_a_drained_or_link_node_are_not_rechecked() -> None:
    tracker = _parked_episode()
    # A training step with no reference adds none; a parked node's record with samples is no probe.
    tracker.probe_step(record(0, 30, 0.1).model_copy(update={"generation": 1}), in_plan=True)
    trained = _probe(1, 31, 5e-3).model_copy(update={"samples": 4})
    tracker.probe_step(trained, in_plan=False)
    assert not tracker.parked._references and not tracker.parked._probes
    # A node still in the plan (drained, not parked) is the validation recheck's, not this one's.
    tracker.probe_step(_reference(0, 31, 5e-3), in_plan=True)
    everyone = frozenset({0, 1, 2, 3})
    for now in (0.0, 1e6):
        _steps(tracker, 5e-3, {}, step=40)
        assert tracker.parked_recheck(everyone, now=now) is None
    # A slow link's end: a probe of its device says nothing of the link.
    tracker.links.add((1, 2))
    assert tracker.parked_recheck(PLAN_WITHOUT_1, now=1e6) is None
    assert _passes(tracker, [5e-3] * AGREE, now=2e6) == [None] * AGREE
    # Once it is a lone slow device, its wait and its windows start then.
    tracker.links.clear()
    assert tracker.parked_recheck(PLAN_WITHOUT_1, now=3e6) is None
    assert _passes(tracker, [5e-3] * AGREE, now=3e6 + tracker.spec.parked_recheck_s)[-1] is not None


def test_each_trip_doubles_the_next_wait_up_to_the_longest_and_is_forgotten_later() -> None:
    recheck = ParkedRecheck(10.0)
    waits = []
    for trip in range(6):
        waits.append(recheck.wait_s(7, now=trip * 1.0))
        recheck.taken_back(7, now=trip * 1.0)
    assert waits == [10, 20, 40, 80, 160, 160]
    assert recheck.wait_s(7, now=5.0 + FORGET * 10.0) == 160  # just at the edge: still remembered
    assert recheck.wait_s(7, now=5.0 + FORGET * 10.0 + 1) == 10 and 7 not in recheck.trips
    assert LONGEST == 16
    # A node that never parks again is forgotten too (not kept in the stored state for good).
    recheck.taken_back(8, now=0.0)
    recheck.due([], now=FORGET * 10.0 + 1)
    assert 8 not in recheck.trips and recheck.state() == {}


def test_a_new_park_starts_its_wait_and_its_level_over() -> None:
    recheck = ParkedRecheck(10.0)
    recheck.reference(0, 1.0)
    assert recheck.due([3], now=0.0) == []
    for _ in range(PROBES):
        recheck.probe(3, 4.0)
    assert recheck.due([3], now=10.0) == [3]
    reading = recheck.judge(3, 1.25)
    assert reading is not None and reading.ratio == 4.0 and not reading.back
    assert recheck.due([], now=11.0) == []  # taken back (its agent's report): forgotten
    # Still out of the plan (another node holds the episode open): its healthy probes come in meanwhile,
    # and must not make the next park's first window.
    for _ in range(PROBES):
        recheck.probe(3, 1.0)
    assert recheck.due([3], now=12.0) == [] and recheck.due([3], now=22.0) == [3]
    assert recheck.judge(3, 1.25) is None
    # Nothing of no duration is a timing.
    for bad in (0.0, 1e-300, float("nan"), float("inf")):
        recheck.probe(3, bad)
        recheck.reference(0, bad)
    assert recheck.judge(3, 1.25) is None


def test_the_trips_survive_an_operator_restart_and_a_malformed_state_is_refused() -> None:
    tracker = _parked_episode()
    tracker.parked_recheck(PLAN_WITHOUT_1, now=0.0)
    tracker.probe_step(_reference(0, 30, 5e-3), in_plan=True)
    first = tracker.spec.parked_recheck_s
    assert _passes(tracker, [5e-3] * AGREE, now=first)[-1] is not None
    stored = json.loads(json.dumps(tracker.state()))
    resumed = FailSlowTracker(tracker.spec)
    resumed.restore(stored)
    assert resumed.parked.trips == tracker.parked.trips and resumed.parked.trips[1][0] == 1
    assert resumed.parked.wait_s(1, now=first + 1) == 2 * first
    for bad in (
        {"1": [1]},
        {"x": [1, 2.0]},
        {"1": "no"},
        {"1": "12"},
        {"1": [-1, 0.0]},
        {"1": [1000, 0.0]},
        {"1": [1.5, 0.0]},
        {"1": [1, float("nan")]},
        {"1": [True, 0.0]},
        [[1, 2.0]],
        5,
        "x",
    ):
        with pytest.raises((ValueError, TypeError)):
            FailSlowTracker(tracker.spec).restore({**stored, "parked_trips": bad})


def test_the_probe_reference_travels_validated_in_the_iteration_record() -> None:
    sent = _reference(0, 3, 4.2e-3)
    assert IterationRecord.model_validate_json(sent.model_dump_json()).probe_s == pytest.approx(4.2e-3)
    assert "probe_s" not in json.loads(record(0, 3, 0.1).model_dump_json(exclude_none=True))
    for bad in (0.0, -1.0, float("nan"), 1e9):
        with pytest.raises(ValueError, match="probe_s"):
            IterationRecord(node=0, generation=0, step=1, seconds=0.1, samples=1, sent_at=0.0, probe_s=bad)
