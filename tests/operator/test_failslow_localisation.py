"""Fail-slow localisation without I/O: the job-wide straggler rule against noise and machine-wide slowdowns,
planned shares of uneven stages, suspicious groups from profiles, the validation flow, S3 (a) for a slow
link, and the episode's state surviving an operator restart."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_failslow_decisions import CLUSTER, PROFILE, grid_plan

from resilientjob.operator._failslow import (
    CANDIDATE_TTL_S,
    Action,
    FailSlowTracker,
    FindingKind,
    Mitigation,
    link_plan,
)
from resilientjob.operator._failslow_types import Candidate
from resilientjob.operator._mitigation import topology_change
from resilientjob.operator._straggler import (
    _median_without,
    communication_suspects,
    group_nodes,
    planned_shares,
)
from resilientjob.operator.api import FailSlowSpec, StrategyOverheads
from resilientjob.planner.failslow import RootCause, Strategy, link_load
from resilientjob.planner.plan import Plan
from resilientjob.protocol.messages import (
    IterationRecord,
    ProfileRecord,
    SlowKind,
    SlowReport,
    ValidationResult,
)

NODES = 8
BASE = 0.1


def report(node: int, step: int, slowdown: float, kind: SlowKind = SlowKind.COMPUTE) -> SlowReport:
    return SlowReport(
        node=node,
        generation=0,
        step=step,
        onset_step=step - 4,
        slowdown=slowdown,
        baseline_s=BASE,
        level_s=BASE * slowdown,
        kind=kind,
        detected_at=0.0,
    )


class Job:
    """Eight workers stepping together (compute_s as the agents report it), one second per step of
    wall-clock for the tracker; `levels(step)` gives each node's compute time."""

    def __init__(self, spec: FailSlowSpec, seed: int = 1) -> None:
        self.tracker = FailSlowTracker(spec)
        self.tracker.gate.new_generation(0, {})
        self.rng = random.Random(seed)
        self.step = 0
        self.generation = 0
        self.mitigations: list[Mitigation] = []

    def run(
        self, steps: int, factor: dict[int, float], noise: float, machine: float = 1.0, comm_s: float = 0.02
    ) -> None:
        for _ in range(steps):
            self.step += 1
            for node in range(NODES):
                compute = BASE * machine * factor.get(node, 1.0) * max(0.2, 1 + self.rng.gauss(0, noise))
                record = IterationRecord(
                    node=node,
                    generation=self.generation,
                    step=self.step,
                    seconds=compute + comm_s,
                    samples=4,
                    sent_at=float(self.step),
                    compute_s=compute,
                    communication_s=comm_s,
                )
                self.tracker.observe(record, now=float(self.step))
                decision = self.tracker.iteration(record)
                if decision is not None:
                    self.mitigations.append(decision)
            self.tracker.tick(now=float(self.step))

    def report(self, node: int, slowdown: float) -> None:
        self.tracker.report(report(node, self.step, slowdown), now=float(self.step))


def test_noise_on_every_node_and_a_machine_wide_slowdown_raise_no_alarm() -> None:
    spec = FailSlowSpec(
        slowdown_threshold=1.1, min_duration_s=5.0, overheads=StrategyOverheads(microbatch_s=0.1)
    )
    job = Job(spec)
    job.run(20, {}, noise=0.15)
    # Noise makes detectors on several nodes fire, as on an overloaded 2-core machine (make demo).
    for node in (2, 3, 7):
        job.report(node, 1.4)
    job.run(10, {}, noise=0.15)
    for node in (0, 3, 7):
        job.report(node, 1.3)
    job.run(40, {}, noise=0.15)
    # Then the whole machine slows down 2x: every node's detector reports it.
    job.run(5, {}, noise=0.05, machine=2.0)
    for node in range(NODES):
        job.report(node, 2.0)
    job.run(int(CANDIDATE_TTL_S) + 5, {}, noise=0.05, machine=2.0)
    assert not job.tracker.active and not job.mitigations and not job.tracker.slow
    findings = job.tracker.drain_findings()
    assert findings and {f.kind for f in findings} == {FindingKind.DISMISSED}
    assert not job.tracker.candidates  # all dismissed within the TTL


def test_one_node_at_1_5x_amid_noise_is_found_and_mitigated() -> None:
    spec = FailSlowSpec(
        slowdown_threshold=1.1, min_duration_s=5.0, overheads=StrategyOverheads(microbatch_s=0.3)
    )
    job = Job(spec, seed=2)
    job.run(20, {}, noise=0.1)
    job.report(3, 1.3)  # a noise report that is never confirmed
    job.run(5, {5: 1.5}, noise=0.1)
    job.report(5, 1.5)
    job.run(4, {5: 1.5}, noise=0.1)
    assert not job.tracker.active  # confirmed, but not yet for min_duration_s
    job.run(20, {5: 1.5}, noise=0.1)
    assert job.tracker.active and set(job.tracker.slow) == {5}
    job.run(30, {5: 1.5}, noise=0.1)
    assert [m.action for m in job.mitigations][:1] == [Action.MICROBATCH]
    assert job.mitigations[0].nodes == (5,)
    kinds = [(f.kind, f.nodes) for f in job.tracker.drain_findings()]
    assert (FindingKind.SLOW, (5,)) in kinds and all(
        nodes != (3,) or k is FindingKind.DISMISSED for k, nodes in kinds
    )


def test_a_straggler_no_agent_reported_is_found_by_the_operators_sweep() -> None:
    # The agents' detectors ignore changes under 25% and miss drifts: a worker 1.35x slower than its peers
    # may never report. The operator's sweep judges every node's window by the job-wide rule itself.
    spec = FailSlowSpec(
        slowdown_threshold=1.2, min_duration_s=2.0, overheads=StrategyOverheads(microbatch_s=1000.0)
    )
    job = Job(spec, seed=4)
    job.run(300, {}, noise=0.08)  # noise alone, for minutes: nothing opens
    job.run(20, {}, noise=0.05, machine=1.5)  # nor does the whole machine slowing down
    assert not job.tracker.active and not job.tracker.candidates
    # The sweep's own hypotheses are not reported as dismissals; the job-level trigger may say that the
    # machine slowed (1.5x for 20 steps of ~0.15s outlasts minDurationS), and nothing else.
    findings = job.tracker.drain_findings()
    assert all(f.kind is FindingKind.DISMISSED and "machine-wide" in f.message for f in findings), findings
    onset = job.step
    job.run(2, {5: 1.35}, noise=0.05)
    assert not job.tracker.active  # a level takes a window of steps, and confirmation a second one
    while not job.tracker.active and job.step < onset + 40:
        job.run(1, {5: 1.35}, noise=0.05)
    assert job.tracker.active and set(job.tracker.slow) == {5}
    # The window is sized from the noise (`test_straggler_window.py`): the machine's change just before
    # widened it for a while, and still the episode opened within a few windows of the onset.
    assert job.step - onset <= 30, job.step - onset
    assert 1.2 < job.tracker.slow[5] < 1.6
    (opened,) = [f for f in job.tracker.drain_findings() if f.kind is FindingKind.SLOW]
    assert "sweep" in opened.message and opened.nodes == (5,)


def test_planned_shares_make_uneven_stages_comparable() -> None:
    # Pipeline 0 runs 8 micro-batches, pipeline 1 only 4 (as after S2): its nodes do half the work, and
    # their compute (the runtime's split; step walls are not divided by shares) takes half the time.
    plan = grid_plan([[0, 1], [2, 3]], microbatches=4)
    pipelines = (plan.pipelines[0].model_copy(update={"microbatches": 8}), plan.pipelines[1])
    skewed = plan.model_copy(update={"pipelines": pipelines})
    shares = planned_shares(skewed, PROFILE)
    assert shares[0] == pytest.approx(2 * shares[2]) and shares[1] == pytest.approx(shares[0])
    tracker = FailSlowTracker(FailSlowSpec(min_duration_s=0))
    tracker.gate.new_generation(0, shares)
    for step in range(10):
        for node, seconds in {0: 0.2, 1: 0.2, 2: 0.1, 3: 0.1}.items():
            tracker.observe(
                IterationRecord(
                    node=node, generation=0, step=step, seconds=seconds, samples=1, sent_at=0,
                    compute_s=seconds, communication_s=0.0,
                )
            )  # fmt: skip
    assert [tracker.gate.straggler(node) for node in range(4)] == [False] * 4  # 2x the work, 2x the time
    unscaled = FailSlowTracker(FailSlowSpec(min_duration_s=0))
    unscaled.gate.new_generation(0, {})
    for step in range(10):
        for node, seconds in {0: 0.2, 1: 0.2, 2: 0.1, 3: 0.1}.items():
            unscaled.observe(
                IterationRecord(
                    node=node, generation=0, step=step, seconds=seconds, samples=1, sent_at=0,
                    compute_s=seconds, communication_s=0.0,
                )
            )  # fmt: skip
    assert unscaled.gate.straggler(0) is True  # without the plan's shares it would be a false alarm


def test_a_straggler_must_cost_the_job_a_threshold_of_its_step() -> None:
    """Compute 2.5x the others' is a straggler when compute fills the step, and is ignored when compute is a
    sliver of a communication-bound step (the demo job: ~5 ms of a 40 ms step)."""
    for compute_s, expected in ((0.005, False), (0.035, True)):
        tracker = FailSlowTracker(FailSlowSpec(min_duration_s=0, slowdown_threshold=1.5))
        tracker.gate.new_generation(0, {})
        for step in range(10):
            for node in range(4):
                own = compute_s * (2.5 if node == 3 else 1.0)
                tracker.observe(
                    IterationRecord(
                        node=node,
                        generation=0,
                        step=step,
                        seconds=0.04 + own - compute_s,
                        samples=1,
                        sent_at=0,
                        compute_s=own,
                        communication_s=0.04 - compute_s,
                    )
                )
        assert tracker.gate.straggler(3) is expected, compute_s
        assert tracker.gate.straggler(0) is False
        # A dismissal says which part of the rule failed.
        assert tracker.gate.why_not(0) == (
            "its compute per share of the work took 1.00x the other nodes' median, not over the 1.5x "
            "threshold"
        )
        if not expected:
            assert tracker.gate.why_not(3) == (
                "its compute per share of the work took 2.50x the other nodes' median, but the 0.0075 s it "
                "adds to a step is under 0.5 of the job's 0.04 s step"
            )


def profile(node: int, groups: dict[str, float]) -> ProfileRecord:
    return ProfileRecord(
        node=node,
        generation=0,
        step=10,
        iterations=5,
        iteration_s=0.5,
        compute_s=0.3,
        communication_s=0.2,
        groups=groups,
        sent_at=0.0,
    )


def test_groups_above_1_1x_their_class_median_are_communication_suspects() -> None:
    # DP groups of 2 (stage pairs) and p2p groups; the all-reduce of {2,3} is slow, p2p 4->5 too.
    dp = {"0,1": 0.10, "2,3": 0.25, "4,5": 0.10, "6,7": 0.105}
    p2p = {"0,2@2": 0.01, "1,3@3": 0.01, "4,5@5": 0.03}
    profiles = {
        n: profile(n, {label: s for label, s in {**dp, **p2p}.items() if n in group_nodes(label)})
        for n in range(8)
    }
    found = communication_suspects(profiles)
    assert found == {"2,3": (2, 3), "4,5@5": (4, 5)}
    assert group_nodes("0,1@1") == (0, 1) and group_nodes("x,1") == () and group_nodes("") == ()
    assert communication_suspects({0: profile(0, {"0,1": 9.0})}) == {}  # alone in its class: no median


def result(request_id: int, links: list[tuple[int, int]], nodes: tuple[int, ...] = ()) -> ValidationResult:
    return ValidationResult(
        id=request_id,
        generation=0,
        step=30,
        gemm_s=dict.fromkeys(range(4), 0.01),
        slow_links=links,
        slow_nodes=list(nodes),
        held_s=0.8,
        finished_at=0.0,
    )


def test_a_communication_report_is_validated_and_its_slow_link_drives_topology() -> None:
    spec = FailSlowSpec(min_duration_s=0, overheads=StrategyOverheads(microbatch_s=0.1, topology_s=0.5))
    tracker = FailSlowTracker(spec)
    tracker.profile(profile(0, {"0,2": 0.3, "1,3": 0.1, "4,5": 0.1}))
    tracker.report(report(2, 20, 1.6, SlowKind.COMMUNICATION), now=0.0)
    assert tracker.validation_wanted() == [0, 2]  # the reporter and the slow group's nodes
    tracker.validation_sent(7, now=0.0)
    assert tracker.validation_wanted() is None  # one pass at a time
    tracker.tick(now=1.0)
    assert not tracker.active  # waits for the result
    tracker.validated(result(6, [(0, 2)]))  # another pass's result: ignored
    assert tracker.awaiting is not None
    tracker.validated(result(7, [(0, 2)]))
    tracker.tick(now=1.0)
    assert tracker.active and tracker.links == {(0, 2)} and set(tracker.slow) == {0, 2}
    kinds = [f.kind for f in tracker.drain_findings()]
    assert kinds == [FindingKind.SLOW_LINK, FindingKind.SLOW]
    mitigation = None
    for step in range(21, 40):
        mitigation = mitigation or tracker.iteration(
            IterationRecord(node=0, generation=0, step=step, seconds=0.2, samples=1, sent_at=0)
        )
    # S2 cannot help a slow link (Falcon Table 3): the first rung is S3, with the link.
    assert mitigation is not None and mitigation.action is Action.TOPOLOGY and mitigation.links == ((0, 2),)


def _asked_to_validate(spec: FailSlowSpec, detected_at: float, now: float) -> FailSlowTracker:
    """A tracker with one communication report, detected at `detected_at`, whose validation pass is out."""
    tracker = FailSlowTracker(spec)
    slow = report(2, 20, 1.6, SlowKind.COMMUNICATION).model_copy(update={"detected_at": detected_at})
    tracker.report(slow, now=now)
    tracker.validation_sent(1, now=now)
    return tracker


def test_a_failed_node_is_no_suspect_of_a_validation_pass() -> None:
    # Seen by a user (2026-11-29): after node 1 was killed, validation passes still named it a suspect, from
    # the profiles of the generation before, and waited on a node that would never answer.
    tracker = FailSlowTracker(FailSlowSpec(min_duration_s=0))
    tracker.profile(profile(0, {"0,1": 0.3, "2,3": 0.1}))
    tracker.profile(profile(1, {"0,1": 0.3, "2,3": 0.1}))
    tracker.forget([1])
    tracker.report(report(2, 20, 1.6, SlowKind.COMMUNICATION), now=0.0)
    assert tracker.validation_wanted() == [0, 2]


def test_a_validated_report_counts_its_duration_from_its_detection_not_from_the_validation() -> None:
    spec = FailSlowSpec(min_duration_s=1.0)
    # Detected at t=100 (the agent's clock), the link named by the pass at t=101.5: with minDurationS 1 the
    # slowdown has lasted long enough when the result comes, and the episode opens at once.
    early = _asked_to_validate(spec, detected_at=100.0, now=100.2)
    early.validated(result(1, [(0, 2)]))
    early.tick(now=101.5)
    assert early.active and early.links == {(0, 2)}
    # One detected just before the result still waits its minDurationS...
    late = _asked_to_validate(spec, detected_at=101.4, now=101.4)
    late.validated(result(1, [(0, 2)]))
    late.tick(now=101.5)
    assert not late.active
    late.tick(now=102.5)
    assert late.active
    # ...and a pass that timed out proves nothing: the duration counts from the timeout.
    unproven = _asked_to_validate(spec.model_copy(update={"validation_timeout_s": 1.0}), 90.0, now=100.0)
    assert unproven.validation_timeout(now=101.0)
    unproven.tick(now=101.0)
    assert not unproven.active
    unproven.tick(now=102.0)
    assert unproven.active


def test_validation_that_finds_nothing_dismisses_and_a_timeout_goes_on() -> None:
    spec = FailSlowSpec(min_duration_s=0, validation_timeout_s=5.0)
    tracker = FailSlowTracker(spec)
    tracker.report(report(1, 20, 1.5, SlowKind.COMMUNICATION), now=0.0)
    tracker.validation_sent(1, now=0.0)
    tracker.validated(result(1, []))
    tracker.tick(now=1.0)
    assert not tracker.active and not tracker.candidates
    assert [f.kind for f in tracker.drain_findings()] == [FindingKind.DISMISSED]
    tracker.report(report(1, 40, 1.5, SlowKind.COMMUNICATION), now=10.0)
    tracker.validation_sent(2, now=10.0)
    assert not tracker.validation_timeout(now=14.0)
    assert tracker.validation_timeout(now=15.5) and tracker.awaiting is None
    tracker.tick(now=15.5)
    assert tracker.active and set(tracker.slow) == {1} and not tracker.links


def test_s3a_moves_a_slow_data_parallel_link_onto_a_pipeline_path() -> None:
    plan = grid_plan([[0, 1, 2], [3, 4, 5]])  # DP2 x PP3: 0-3, 1-4, 2-5 carry the all-reduce
    assert link_load(plan, PROFILE, [(1, 4)]) > 0
    moved = link_plan(plan, PROFILE, CLUSTER, [(1, 4)], sync_s=0.0)
    assert isinstance(moved, Plan) and moved.generation == plan.generation + 1
    # uniform_profile's stages send no activations, so once off the ring the link carries nothing.
    assert link_load(moved, PROFILE, [(1, 4)]) == 0 and sorted(moved.nodes) == list(range(6))
    assert moved.transfers and {t.dst for t in moved.transfers} <= set(range(6))
    assert "do not join" in str(link_plan(plan, PROFILE, CLUSTER, [(1, 9)], sync_s=0.0))
    # Through the mitigation path: a link and a compute straggler in one generation.
    mixed = Mitigation(Action.TOPOLOGY, {1: 1.5, 4: 1.5, 0: 2.0, 5: 2.0}, "", 1.0, 0.0, ((1, 4),))
    both = topology_change(plan, PROFILE, CLUSTER, mixed, 0.0)
    assert isinstance(both, Plan) and both.generation == plan.generation + 1
    stage_of = {s.node: c for p in both.pipelines for c, s in enumerate(p.stages)}
    assert link_load(both, PROFILE, [(1, 4)]) == 0 and stage_of[0] == stage_of[5]
    # One set of copies from the current layout to the final one.
    assert {t.dst for t in both.transfers} <= {n for n in range(6) if stage_of[n] != plan_stage(plan, n)}


def test_s3a_acts_on_the_demos_asymmetric_layout_without_copies() -> None:
    # DP4 PP[2,2,1,1] (the shape of the demo's layout): the slow link 0-2 joins the two 2-stage pipelines'
    # first stages, neighbours on the ring of layers 0-2. S3 (a) reorders the pipelines; nothing is copied.
    two = grid_plan([[0, 1], [2, 3]], microbatches=2).pipelines
    one = grid_plan([[4], [5]], microbatches=2).pipelines
    plan = grid_plan([[0, 1], [2, 3]]).model_copy(update={"pipelines": two + one})
    assert link_load(plan, PROFILE, [(0, 2)]) > 0
    moved = link_plan(plan, PROFILE, CLUSTER, [(2, 0)], sync_s=0.0)
    assert isinstance(moved, Plan) and moved.generation == plan.generation + 1
    assert link_load(moved, PROFILE, [(0, 2)]) == 0 and moved.transfers == ()
    assert moved.layers_by_node() == plan.layers_by_node() and moved.layout != plan.layout
    assert "no move" in str(link_plan(moved, PROFILE, CLUSTER, [(0, 2)], sync_s=0.0))


def plan_stage(plan: Plan, node: int) -> int:
    return next(c for p in plan.pipelines for c, s in enumerate(p.stages) if s.node == node)


def test_the_episode_state_survives_a_restart_at_the_same_rung() -> None:
    overheads = StrategyOverheads(microbatch_s=0.5, topology_s=2.0, restart_s=5.0)
    spec = FailSlowSpec(overheads=overheads, min_duration_s=0)
    tracker = FailSlowTracker(spec)
    tracker.gate.new_generation(0, {})
    for step in range(10, 21):
        for node, seconds in ((0, 0.1), (1, 0.2 if step >= 16 else 0.1), (2, 0.1)):
            tracker.observe(
                IterationRecord(node=node, generation=0, step=step, seconds=seconds, samples=1, sent_at=0)
            )
    tracker.report(report(1, 20, 2.0), now=0.0)
    tracker.tick(now=0.0)
    first = [
        tracker.iteration(IterationRecord(node=1, generation=0, step=s, seconds=0.2, samples=1, sent_at=0))
        for s in range(21, 26)
    ]
    assert [m.action for m in first if m is not None] == [Action.MICROBATCH]
    state = json.loads(json.dumps(tracker.state()))  # as stored in Redis
    restarted = FailSlowTracker(spec)
    restarted.restore(state)
    assert restarted.active and restarted.slow == tracker.slow
    assert restarted.controller.loss_s == pytest.approx(tracker.controller.loss_s)
    assert restarted.controller.applied == (Strategy.MICROBATCH,)
    later = [
        restarted.iteration(IterationRecord(node=1, generation=0, step=s, seconds=0.2, samples=1, sent_at=0))
        for s in range(26, 80)
    ]
    # The next rung, not S2 again; and steps already fed before the restart are not charged twice.
    assert [m.action for m in later if m is not None] == [Action.TOPOLOGY, Action.REPLACE]
    assert (
        restarted.iteration(IterationRecord(node=1, generation=0, step=22, seconds=0.2, samples=1, sent_at=0))
        is None
    )
    assert RootCause.COMPUTE.value in state["episode"]["causes"]


@given(st.lists(st.floats(0, 10), min_size=1, max_size=30), st.data())
def test_median_without_one_element_matches_the_definition(values: list[float], data: st.DataObject) -> None:
    ordered = sorted(values)
    skip = data.draw(st.integers(0, len(ordered) - 1))
    rest = ordered[:skip] + ordered[skip + 1 :]
    expected = statistics.median(rest) if rest else None
    assert _median_without(ordered, skip) == (pytest.approx(expected) if rest else None)
    assert _median_without(ordered, None) == pytest.approx(statistics.median(ordered))


def test_a_compute_episode_counts_its_loss_in_compute_time() -> None:
    tracker = FailSlowTracker(FailSlowSpec(min_duration_s=0))
    tracker.gate.new_generation(0, {})

    def step(node: int, index: int, compute: float) -> IterationRecord:
        # 0.1 s of communication on top of compute, as a compute detector's report leaves it out.
        return IterationRecord(
            node=node,
            generation=0,
            step=index,
            seconds=compute + 0.1,
            samples=1,
            sent_at=0,
            compute_s=compute,
        )

    for index in range(10, 21):
        for node in range(3):
            tracker.observe(step(node, index, 0.2 if node == 1 and index >= 16 else 0.1))
    tracker.report(report(1, 20, 2.0), now=0.0)  # baseline 0.1 s of compute, now 0.2 s
    tracker.tick(now=0.0)
    opened = tracker.controller.loss_s
    for index in range(21, 31):
        tracker.iteration(step(1, index, 0.2))
    assert tracker.controller.loss_s == pytest.approx(opened + 10 * 0.1)  # not 10 x 0.2 with communication


def test_s4_takes_out_one_end_of_each_slow_link_and_every_slow_device() -> None:
    from resilientjob.operator._failslow import Action, Mitigation
    from resilientjob.operator._mitigation import replaced_nodes

    def mitigation(factors: dict[int, float], links: tuple[tuple[int, int], ...]) -> Mitigation:
        return Mitigation(Action.REPLACE, factors, "test", loss_s=1.0, detect_s=0.0, links=links)

    assert replaced_nodes(mitigation({0: 2.0, 2: 2.0}, ((0, 2),))) == [0]
    # Node 3 is on both slow links: taking it out clears them; node 5 is a slow device of its own.
    assert replaced_nodes(mitigation({1: 2.0, 3: 2.0, 4: 2.0, 5: 1.5}, ((1, 3), (3, 4)))) == [3, 5]
    assert replaced_nodes(mitigation({6: 1.5}, ())) == [6]
    # The mixed bench: links 0-2 (congested) and 4-5 (named by noise), node 5's device slow. Parking 4 for
    # the link left the slow GPU in the layout, and S4 made the job slower; the device covers its link.
    both = Mitigation(Action.REPLACE, {0: 1.9, 2: 1.9, 4: 1.9, 5: 2.0}, "", 1.0, 0.0, ((0, 2), (4, 5)))
    assert replaced_nodes(both) == [0, 4]
    assert replaced_nodes(dataclasses.replace(both, devices=(5,))) == [0, 5]


def _after_a_link_episode(links: list[tuple[int, int]], devices: tuple[int, ...] = ()) -> Job:
    """Eight nodes 12 steps into an episode that a communication report opened and whose validation pass
    named `links` (and `devices`); small overheads, so that S2 and S3 come quickly and S4 does not."""
    spec = FailSlowSpec(
        slowdown_threshold=1.3,
        min_duration_s=0,
        overheads=StrategyOverheads(microbatch_s=0.5, topology_s=0.3, restart_s=1000.0),
    )
    job = Job(spec, seed=3)
    job.run(20, {}, noise=0.02)
    job.run(4, {}, noise=0.02, comm_s=0.1)  # the link slows the steps (the report's onset is 4 steps back)
    job.tracker.report(report(2, job.step, 1.6, SlowKind.COMMUNICATION), now=float(job.step))
    assert job.tracker.validation_wanted() is not None
    job.tracker.validation_sent(1, now=float(job.step))
    job.tracker.validated(result(1, links, nodes=devices))
    # The link slows every step of the job: its ends' walls grow, their compute does not.
    job.run(12, {}, noise=0.02)
    return job


def test_a_compute_straggler_after_a_link_episode_gets_s2_before_s4() -> None:
    # Falcon Fig. 17's mixed case: a slow link opens the episode (S3 moves it off the all-reduce), then a
    # GPU slows. S2 fixes compute causes: it is the next rung, for that GPU only (the link's ends compute
    # at full speed), before S4; each decision names what was measured before and after the last rung.
    job = _after_a_link_episode([(0, 2)])
    assert job.tracker.active and job.tracker.links == {(0, 2)}
    first = [m.action for m in job.mitigations]
    assert first == [Action.TOPOLOGY], first
    job.run(10, {5: 2.0}, noise=0.02)
    job.report(5, 2.0)
    job.run(20, {5: 2.0}, noise=0.02)
    actions = [m.action for m in job.mitigations]
    assert actions == [Action.TOPOLOGY, Action.MICROBATCH], actions
    s2 = job.mitigations[1]
    assert set(s2.factors) == {5} and s2.factors[5] > 1.5, s2.factors
    assert "after topology:" in s2.measured and "measured" in s2.measured, s2.measured
    snapshot = job.tracker.controller.snapshot()
    assert snapshot is not None and set(snapshot["causes"]) == {"communication", "compute"}


@pytest.mark.parametrize("named_by", ["compute report", "validation"])
def test_s2_balances_a_slow_device_that_is_also_a_slow_links_end(named_by: str) -> None:
    # The mixed bench on the local stack: the first pass named the congested link 0->2 and, by noise, 5->6;
    # then node 5's GPU slowed. Counted only as a link's end, node 5 was left out of S2's balance, S2 fell
    # back to every slow node's factor and declined ("the current split is already the best"). The first
    # pass also timed node 2's GEMM slow by noise: the end of a slow link whose compute the job-wide rule
    # finds healthy is not a slow device (the next run made S2 the link episode's first rung that way).
    job = _after_a_link_episode([(0, 2), (5, 6)], devices=(2,))
    assert job.tracker.links == {(0, 2), (5, 6)} and job.tracker.devices == set()
    job.run(10, {5: 2.0}, noise=0.02)
    if named_by == "compute report":
        job.report(5, 2.0)
    else:  # a communication report whose pass times node 5's GEMM slow (and, by noise, a link 3->4)
        job.run(4, {5: 2.0}, noise=0.02, comm_s=0.1)  # node 4 waits (the report's onset is 4 steps back)
        job.tracker.report(report(4, job.step, 1.5, SlowKind.COMMUNICATION), now=float(job.step))
        job.tracker.validation_sent(2, now=float(job.step))
        job.tracker.validated(result(2, [(3, 4)], nodes=(5,)))
    job.run(20, {5: 2.0}, noise=0.02)
    assert 5 in job.tracker.devices
    actions = [m.action for m in job.mitigations]
    assert actions[:2] == [Action.TOPOLOGY, Action.MICROBATCH], actions
    assert set(job.mitigations[1].factors) == {5}, job.mitigations[1].factors
    assert job.mitigations[1].devices == (5,)  # what S4 will park, should the episode get there
    # The device's part survives an operator restart.
    resumed = FailSlowTracker(job.tracker.spec)
    resumed.restore(json.loads(json.dumps(job.tracker.state())))
    assert resumed.devices == job.tracker.devices


def _s2_for_node_5() -> tuple[FailSlowSpec, Job]:
    """A job whose node 5 turned 2x slow and got S2 (cheap, the other rungs priced out)."""
    spec = FailSlowSpec(
        slowdown_threshold=1.3,
        min_duration_s=0,
        overheads=StrategyOverheads(microbatch_s=0.5, topology_s=1000.0, restart_s=1000.0),
    )
    job = Job(spec, seed=5)
    job.run(20, {}, noise=0.02)
    job.run(5, {5: 2.0}, noise=0.02)
    job.report(5, 2.0)
    job.run(30, {5: 2.0}, noise=0.02)
    return spec, job


@pytest.mark.parametrize(
    ("after", "published", "reverted"), [(1.6, True, True), (0.75, True, False), (1.6, False, False)]
)
def test_a_first_rung_that_made_the_job_slower_is_reverted_once(
    after: float, published: bool, reverted: bool
) -> None:
    # S2 is chosen from estimates; on a noisy host they can be wrong and the job run slower than with the
    # slowdown left alone. The steps of the generation that published the rung are compared with those
    # before it: slower by the threshold, and the plan from before the episode is published again. A rung
    # that was not published (nothing would help) is not judged: the job's steps then say nothing of it.
    spec, job = _s2_for_node_5()
    assert [m.action for m in job.mitigations] == [Action.MICROBATCH]
    s2 = job.mitigations[0]
    if published:
        job.tracker.published(s2, generation=2)  # a fail-stop took generation 1 meanwhile
    else:
        job.tracker.not_published(s2)
    job.generation = 1  # steps of another generation than the rung's do not count, however slow
    job.run(12, {5: 2.0 * 3}, noise=0.02)
    assert [m.action for m in job.mitigations] == [Action.MICROBATCH]
    job.generation = 2  # the S2 plan runs: node 5's step (the job's: all wait for it) is `after` x before
    job.run(12, {5: 2.0 * after}, noise=0.02)
    actions = [m.action for m in job.mitigations]
    assert actions == ([Action.MICROBATCH, Action.REVERT] if reverted else [Action.MICROBATCH]), actions
    if reverted:
        revert = job.mitigations[-1]
        assert "microbatch made the job slower" in revert.reason and set(revert.factors) == {5}
    assert job.tracker.active  # the episode goes on either way
    # Judged once, also across an operator restart: the restarted tracker goes on with the job.
    restarted = FailSlowTracker(spec)
    restarted.restore(json.loads(json.dumps(job.tracker.state())))
    restarted.gate.new_generation(2, {})
    assert restarted.rung_check.judged is published
    job.tracker = restarted
    job.generation = 3
    job.run(20, {5: 4.0 * after}, noise=0.02)
    assert [m.action for m in job.mitigations].count(Action.REVERT) == (1 if reverted else 0)


def test_a_recovery_report_of_a_straggler_still_slow_by_the_job_wide_rule_keeps_the_episode() -> None:
    # After S2 the straggler runs fewer micro-batches and its peers wait less: their own detectors may see
    # their steps shorten and report a recovery. A restore then would bring the slowdown straight back
    # (the demo did that once): the job-wide rule must still find the node over the threshold to let go.
    spec = FailSlowSpec(
        slowdown_threshold=1.3, min_duration_s=0, overheads=StrategyOverheads(microbatch_s=0.3)
    )
    job = Job(spec, seed=4)
    job.run(20, {}, noise=0.02)
    job.run(4, {5: 2.0}, noise=0.02)
    job.report(5, 2.0)
    job.run(20, {5: 2.0}, noise=0.02)
    assert [m.action for m in job.mitigations] == [Action.MICROBATCH]
    back = report(5, job.step, 0.8).model_copy(update={"recovered": True})
    assert job.tracker.report(back, now=float(job.step)) is None
    assert job.tracker.active and set(job.tracker.slow) == {5}
    findings = job.tracker.drain_findings()
    assert any(f.kind is FindingKind.DISMISSED and "recovery report ignored" in f.message for f in findings)
    assert not any(f.kind is FindingKind.RECOVERED for f in findings)
    # Truly back: the same report now ends the episode and asks for the healthy plan.
    job.run(12, {}, noise=0.02)
    back = report(5, job.step, 0.5).model_copy(update={"recovered": True})
    restore = job.tracker.report(back, now=float(job.step))
    assert restore is not None and restore.action is Action.RESTORE
    assert not job.tracker.slow


class SynchronousJob:
    """Eight nodes that wait for the slowest at every step (their walls are the slowest compute plus
    `comm_s`), under the published plan's shares: a node's compute is BASE x its share x its slowdown."""

    def __init__(self, spec: FailSlowSpec, comm_s: float) -> None:
        self.tracker = FailSlowTracker(spec)
        self.tracker.gate.new_generation(0, {})
        self.comm_s, self.generation, self.step = comm_s, 0, 0
        self.shares: dict[int, float] = {}
        self.mitigations: list[Mitigation] = []
        self.rng = random.Random(7)

    def publish(self, shares: dict[int, float]) -> None:
        self.generation += 1
        self.shares = shares
        self.tracker.published(self.mitigations[-1], self.generation)
        self.tracker.gate.new_generation(self.generation, shares)

    def run(self, steps: int, slowdown: dict[int, float]) -> None:
        for _ in range(steps):
            self.step += 1
            compute = {
                node: BASE
                * self.shares.get(node, 1.0)
                * slowdown.get(node, 1.0)
                * (1 + self.rng.gauss(0, 0.02))
                for node in range(NODES)
            }
            wall = max(compute.values()) + self.comm_s
            for node, own in compute.items():
                record = IterationRecord(
                    node=node, generation=self.generation, step=self.step, seconds=wall, samples=4,
                    sent_at=0.0, compute_s=own, communication_s=wall - own,
                )  # fmt: skip
                self.tracker.observe(record)
                decision = self.tracker.iteration(record)
                if decision is not None:
                    self.mitigations.append(decision)
            self.tracker.tick(now=float(self.step))

    def recovery_report(self, node: int, slowdown: dict[int, float]) -> Mitigation | None:
        """Node's agent reports a recovery with its onset at the latest step, before the steps since then
        have reached the tracker (the reconciler reads reports first): it is judged once they have."""
        onset = {"recovered": True, "generation": self.generation, "onset_step": self.step + 1}
        back = report(node, self.step + 1, 0.6).model_copy(update=onset)
        assert self.tracker.report(back, now=float(self.step)) is None and self.tracker.active
        self.run(6, slowdown)
        return self.tracker.recheck(now=float(self.step))


@pytest.mark.parametrize(("after_s2", "restored"), [(3.0, False), (1.35, False), (1.0, True)])
def test_a_straggler_is_back_when_its_speed_is_not_when_s2_made_it_cheap(
    after_s2: float, restored: bool
) -> None:
    # The demo's job: node 7 slowed x3 costs the job its threshold (1.5); S2 moves half its micro-batches to
    # node 6. Its steps then cost the job under the threshold, and its agent sees them shorten and reports a
    # recovery: judged by what it costs, it was taken and the healthy plan brought the slowdown straight
    # back (restore, then the sweep's new episode, in `rjob demo`). Its speed per planned share decides:
    # still x3 or x1.35 (under the threshold, over the recovery bar of 1.25) stays; x1.0 is back.
    spec = FailSlowSpec(
        slowdown_threshold=1.5, min_duration_s=0, overheads=StrategyOverheads(microbatch_s=0.3)
    )
    job = SynchronousJob(spec, comm_s=0.08)
    job.run(20, {})
    job.run(4, {7: 3.0})
    job.tracker.report(report(7, job.step, 3.0), now=float(job.step))
    job.run(12, {7: 3.0})
    assert [m.action for m in job.mitigations] == [Action.MICROBATCH]
    job.publish({7: 0.5, 6: 1.5})
    job.run(12, {7: after_s2})
    gate = job.tracker.gate
    assert gate.judge({7: job.step - 8})[7] is False  # whatever its speed, under S2 it costs under 1.5x
    decision = job.recovery_report(7, {7: after_s2})
    if restored:
        assert decision is not None and decision.action is Action.RESTORE and not job.tracker.slow
    else:
        assert decision is None and job.tracker.active and set(job.tracker.slow) == {7}
        findings = job.tracker.drain_findings()
        assert any("recovery report ignored for nodes [7]: still over 1.25x" in f.message for f in findings)


@pytest.mark.parametrize("named", [(1, 6, 7), (1, 6)])
def test_devices_that_validation_names_alone_must_be_slow_by_the_job_wide_rule(
    named: tuple[int, ...],
) -> None:
    # In `rjob demo` the peers waiting for the x3 worker 7 report communication slowdowns; the validation
    # pass they ask for timed GEMM on a 2-core host and named nodes 1 (1.38x) and 6 (1.90x) beside 7. All
    # three went into the episode and S2 moved work off the two healthy ones. Their compute says otherwise.
    spec = FailSlowSpec(
        slowdown_threshold=1.5, min_duration_s=0, overheads=StrategyOverheads(microbatch_s=0.3)
    )
    job = SynchronousJob(spec, comm_s=0.08)
    slow = {7: 3.0} if 7 in named else {}
    job.run(20, {})
    if 7 not in named:
        job.comm_s = 0.3  # the steps slowed by what the pass does not find (a communication report needs it)
    job.run(6, slow)
    waiting = report(3, job.step, 2.4, SlowKind.COMMUNICATION)
    job.tracker.report(waiting, now=float(job.step))
    assert job.tracker.validation_wanted() is not None
    job.tracker.validation_sent(1, now=float(job.step))
    job.tracker.validated(result(1, [], named))
    job.tracker.tick(now=float(job.step))
    findings = job.tracker.drain_findings()
    assert any("slow devices on nodes [1, 6] named by validation alone" in f.message for f in findings)
    if 7 in named:
        assert job.tracker.active and set(job.tracker.slow) == {7} and job.tracker.devices == {7}
        # As slow as its own compute says (x3), not as the waiting reporter's step (2.4x): what S2 balances.
        assert job.tracker.slow[7] == pytest.approx(3.0, rel=0.05)
    else:
        assert not job.tracker.active and not job.tracker.slow and not job.tracker.candidates
        assert any("validation named no slow link, and no device" in f.message for f in findings)


def _link_and_device_named(device_compute_s: float) -> tuple[FailSlowTracker, Mitigation | None]:
    """A communication report whose validation names the link 0-2 and node 3's device; node 3's compute
    in the traces is `device_compute_s` against the others' 0.02 s of a 0.2 s step."""
    spec = FailSlowSpec(min_duration_s=0, overheads=StrategyOverheads(microbatch_s=0.1, topology_s=0.5))
    tracker = FailSlowTracker(spec)
    tracker.gate.new_generation(0, {})
    for step in range(20):
        wall = 0.2 if step < 16 else 0.32  # the link slows every step from the report's onset (16)
        for node in range(4):
            own = device_compute_s if node == 3 else 0.02
            tracker.observe(
                IterationRecord(
                    node=node, generation=0, step=step, seconds=wall, samples=1, sent_at=0,
                    compute_s=own, communication_s=wall - own,
                )
            )  # fmt: skip
    tracker.report(report(2, 20, 1.6, SlowKind.COMMUNICATION), now=0.0)
    tracker.validation_sent(1, now=0.0)
    tracker.validated(result(1, [(0, 2)], nodes=(3,)))
    tracker.tick(now=1.0)
    mitigation = None
    for step in range(21, 40):
        mitigation = mitigation or tracker.iteration(
            IterationRecord(node=0, generation=0, step=step, seconds=0.2, samples=1, sent_at=0)
        )
    return tracker, mitigation


def test_a_device_validation_alone_names_next_to_a_slow_link_needs_its_compute_to_be_slow() -> None:
    # Measured on the demo's GPT: one GEMM timing on a shared host named a device that no order slowed, the
    # episode became a compute one and S2 moved work off that node while the link stayed slow.
    tracker, mitigation = _link_and_device_named(device_compute_s=0.02)
    assert tracker.active and set(tracker.slow) == {0, 2} and tracker.links == {(0, 2)}
    dismissed = [f for f in tracker.drain_findings() if f.kind is FindingKind.DISMISSED]
    assert [f.nodes for f in dismissed] == [(3,)]
    assert mitigation is not None and mitigation.action is Action.TOPOLOGY and mitigation.links == ((0, 2),)
    # A device whose compute is slow in the traces too stays in the episode, a compute cause with the link.
    tracker, _ = _link_and_device_named(device_compute_s=0.2)
    assert set(tracker.slow) == {0, 2, 3}
    assert not [f for f in tracker.drain_findings() if f.kind is FindingKind.DISMISSED]


def _device_named_then_a_new_generation(device_compute_s: float) -> tuple[FailSlowTracker, list[bool]]:
    """Validation names node 3's device for node 2's communication report; before the episode opens, a
    kill publishes generation 1 (the levels start over); then 20 steps come in which node 3's compute is
    `device_compute_s` against the others' 0.02 s. Returns the tracker and whether an episode was active
    after the first tick and after the new steps."""
    spec = FailSlowSpec(min_duration_s=0)
    tracker = FailSlowTracker(spec)
    tracker.gate.new_generation(0, {})

    def steps(generation: int, first: int, device_s: float, slow_from: int = 1000) -> None:
        for step in range(first, first + 20):
            wall = 0.2 if step < slow_from else 0.32  # node 2's waits, from its report's onset
            for node in (0, 2, 3):
                own = device_s if node == 3 else 0.02
                tracker.observe(
                    IterationRecord(
                        node=node, generation=generation, step=step, seconds=wall, samples=1, sent_at=0,
                        compute_s=own, communication_s=wall - own,
                    )
                )  # fmt: skip

    steps(0, 0, 0.02, slow_from=16)
    tracker.report(report(2, 20, 1.6, SlowKind.COMMUNICATION), now=0.0)
    tracker.validation_sent(1, now=0.0)
    tracker.validated(result(1, [], nodes=(3,)))
    tracker.forget([1])  # node 1 killed: the fail-stop replan publishes generation 1
    tracker.gate.new_generation(1, {})
    tracker.tick(now=1.0)
    active = [tracker.active]
    steps(1, 21, device_compute_s)
    tracker.tick(now=2.0)
    active.append(tracker.active)
    return tracker, active


def test_validations_devices_wait_for_the_job_wide_rule_after_a_new_generation() -> None:
    # Measured in `rjob demo` (fresh clone, 2026-11-27): a pass named node 4 at 1.14x GEMM and the rule
    # found it not slow; a worker was killed the next second, and another report waiting on the same pass
    # opened an episode on node 4, taken on validation's word because the kill had cleared the levels.
    tracker, active = _device_named_then_a_new_generation(device_compute_s=0.02)
    assert active == [False, False] and not tracker.slow and not tracker.candidates
    dismissed = [f.message for f in tracker.drain_findings() if f.kind is FindingKind.DISMISSED]
    assert any("named by validation alone" in message for message in dismissed), dismissed
    # A device that the new steps show slow opens the episode once they are in.
    tracker, active = _device_named_then_a_new_generation(device_compute_s=0.2)
    assert active == [False, True] and set(tracker.slow) == {3}


def _peer_reports_a_device_then_s2(peer: int, own_report: bool) -> SynchronousJob:
    """Node 7 slowed x4; node `peer`, waiting for it, reports a communication slowdown that validation traces
    to node 7's device (and node 7 reports its own compute slowdown if `own_report`); S2 follows."""
    spec = FailSlowSpec(
        slowdown_threshold=1.5, min_duration_s=0, overheads=StrategyOverheads(microbatch_s=0.3)
    )
    job = SynchronousJob(spec, comm_s=0.08)
    job.run(20, {})
    job.run(6, {7: 4.0})
    tracker = job.tracker
    tracker.report(report(peer, job.step, 2.4, SlowKind.COMMUNICATION), now=float(job.step))
    tracker.validation_sent(1, now=float(job.step))
    tracker.validated(result(1, [], (7,)))
    if own_report:
        tracker.report(report(7, job.step, 4.0), now=float(job.step))
    job.run(12, {7: 4.0})
    assert [m.action for m in job.mitigations] == [Action.MICROBATCH] and set(tracker.slow) == {7}
    return job


def test_a_drained_devices_own_recovery_ends_the_episode_its_waiting_peers_opened() -> None:
    # On the local stack: node 3 (x4) drained by S2, the peers that had waited for it reported communication
    # slowdowns that validation traced to its device. Its agent reported its recovery when the order ended;
    # the episode stayed open until a peer's detector happened to report noise as its own recovery, since
    # a drained node's recovery does not shorten the peers' steps.
    job = _peer_reports_a_device_then_s2(peer=2, own_report=True)
    tracker = job.tracker
    job.publish({node: 1.0 for node in range(NODES) if node != 7})
    tracker.idle = frozenset({7})
    for _ in range(10):  # drained: node 7's steps are probes, out of the levels (`TelemetryPass`)
        job.step += 1
        for node in range(NODES):
            record = IterationRecord(
                node=node, generation=job.generation, step=job.step, seconds=0.2, samples=4, sent_at=0.0,
                compute_s=0.004 if node == 7 else BASE, communication_s=0.1,
            )  # fmt: skip
            if node != 7:
                tracker.observe(record)
            assert tracker.iteration(record) is None
    # A waiting peer's recovery says nothing of the drained node (it has no level to check it by).
    recovered = {"recovered": True, "generation": job.generation, "onset_step": job.step - 4}
    peer = report(2, job.step, 0.5, SlowKind.COMMUNICATION).model_copy(update=recovered)
    assert tracker.report(peer, now=float(job.step)) is None
    assert tracker.active and set(tracker.slow) == {7}
    assert any("out of the step (drained or parked)" in f.message for f in tracker.drain_findings())
    back = report(7, job.step, 0.25).model_copy(update=recovered)
    decision = tracker.report(back, now=float(job.step))
    assert decision is not None and decision.action is Action.RESTORE
    assert not tracker.active and not tracker.slow


def test_a_drained_device_only_a_peer_reported_is_back_on_its_own_recovery_report() -> None:
    # `rjob demo`: the episode opened on a waiting peer's (node 3's) communication report that validation
    # traced to node 7's device; node 7's own report had been dismissed. Drained by S2, node 7 was restored
    # 15 s later on node 3's recovery report while its x4 order held, and a new episode slowed the job again.
    # The episode as the operator stored it then (restored into a tracker: the public way to set it up).
    job = _peer_reports_a_device_then_s2(peer=3, own_report=False)
    state = job.tracker.state()
    assert state["sources"]["3"] == [7]
    state["sources"] = {"3": [7]}  # node 7's own report was dismissed: only node 3's led to it
    tracker = FailSlowTracker(job.tracker.spec)
    tracker.restore(json.loads(json.dumps(state)))
    tracker.gate.new_generation(1, {node: 1.0 for node in range(NODES) if node != 7})
    tracker.idle = frozenset({7})
    recovered = {"recovered": True, "generation": 1, "onset_step": job.step}
    peer = report(3, job.step, 0.5, SlowKind.COMMUNICATION).model_copy(update=recovered)
    assert tracker.report(peer, now=float(job.step)) is None and set(tracker.slow) == {7}
    back = report(7, job.step, 0.25).model_copy(update=recovered)
    decision = tracker.report(back, now=float(job.step))
    assert decision is not None and decision.action is Action.RESTORE and not tracker.slow


def test_validations_findings_say_how_slow_it_timed_what_it_named() -> None:
    from resilientjob.operator._failslow_validation import named_by
    from resilientjob.protocol.messages import LinkTiming

    timed = result(3, [(0, 2)], nodes=(1,)).model_copy(
        update={
            "gemm_s": {0: 0.01, 1: 0.025, 2: 0.01},
            "links": [
                LinkTiming(src=src, dst=dst, seconds=seconds)
                for src, dst, seconds in ((0, 2, 0.006), (2, 1, 0.002), (1, 0, 0.002))
            ],
        }
    )
    links, devices, findings = named_by(timed)
    assert links == [(0, 2)] and devices == [1]
    assert [f.kind for f in findings] == [FindingKind.SLOW_LINK, FindingKind.SLOW_DEVICE]
    assert "found slow links 0->2 (transfer vs median: 0->2: 3.00x)" in findings[0].message
    assert "nodes [1] (GEMM vs median: 1: 2.50x)" in findings[1].message


def test_a_first_rung_is_judged_on_the_world_that_re_formed_with_its_layout() -> None:
    # The rung's generation aborted a step with every node alive and re-formed as the next generation with
    # the same layout (`_aborts`): the rung's steps go on under it. Before, they counted for nothing there
    # and the rung was never judged.
    _, job = _s2_for_node_5()
    job.tracker.published(job.mitigations[0], generation=1)
    job.generation = 1
    job.run(3, {5: 2.0 * 1.6}, noise=0.02)  # a few steps of the rung, then the world re-forms
    job.tracker.same_layout(1, 2)
    job.tracker.same_layout(0, 3)  # another generation's republication moves nothing
    assert job.tracker.rung_check.generation == 2
    job.generation = 2
    job.run(12, {5: 2.0 * 1.6}, noise=0.02)
    assert [m.action for m in job.mitigations] == [Action.MICROBATCH, Action.REVERT]


def _waited(tracker: FailSlowTracker, node: int, step: int, wall: float) -> None:
    """A step of `node` with this wall and a steady compute (only its waits move), at `step` seconds."""
    tracker.observe(
        IterationRecord(
            node=node, generation=0, step=step, seconds=wall, samples=4, sent_at=float(step), compute_s=0.05,
            communication_s=wall - 0.05,
        ),
        now=float(step),
    )  # fmt: skip


def test_a_communication_report_is_validated_once_its_steps_clear_their_noise_and_dismissed_if_back() -> None:
    """Every agent of a job on a shared host sees the same step-time blips; their step-time reports
    (1.25-1.3x) asked for a validation pass every 20 s of a healthy demo job at threshold 1.2 on two
    cores, and one pass timed a link slow by chance and opened an episode. A communication report now asks
    for a pass once the reporter's steps since its onset clear their own noise, as the job-level trigger's
    must; a blip that is over first is dismissed. A slowdown that lasts is validated, a large one at once."""
    spec = FailSlowSpec(
        slowdown_threshold=1.2, min_duration_s=0, overheads=StrategyOverheads(microbatch_s=1.0)
    )
    tracker = FailSlowTracker(spec)
    tracker.gate.new_generation(0, {})
    steps = iter(range(1, 1000))
    healthy = [0.09, 0.10, 0.11, 0.12, 0.13]  # the steps' own noise: 13.5% (1.4826 MAD / median)

    def run(walls: list[float]) -> int:
        """Eight nodes step together with these walls (their compute steady: only the waits move)."""
        step = 0
        for wall in walls:
            step = next(steps)
            for node in range(NODES):
                _waited(tracker, node, step, wall)
            tracker.tick(now=float(step))
        return step

    def reported(walls: list[float], slowdown: float) -> None:
        """The steps of a rise, and the reporter's report with its onset at their first."""
        last = run(walls)
        onset = {"onset_step": last - len(walls) + 1, "baseline_s": 0.11}
        slow = report(3, last, slowdown, SlowKind.COMMUNICATION).model_copy(update=onset)
        tracker.report(slow, now=float(last))

    run(healthy * 8)
    reported([0.14] * 4, 1.27)  # 1.27x on four steps: noise of 13.5% takes a median of 4 that far
    assert tracker.validation_wanted() is None and 3 in tracker.candidates
    run(healthy + healthy[:3])  # and it was over
    assert tracker.validation_wanted() is None and 3 not in tracker.candidates
    dismissed = [f.message for f in tracker.drain_findings() if f.kind is FindingKind.DISMISSED]
    assert any("node 3" in m and "is back under 1.18x its level before" in m for m in dismissed), dismissed

    # The same rise, lasting: a pass once enough of its steps are in (a few more at this noise).
    run(healthy * 8)
    reported([0.14] * 4, 1.27)
    waited = 0
    while tracker.validation_wanted() is None and waited < 20:
        run([0.14])
        waited += 1
    assert tracker.validation_wanted() == [3] and 1 <= waited <= 4, waited

    # A link that makes every step 3x slower clears the noise on the report's own four steps.
    tracker.validation_sent(1, now=float(next(steps)))
    tracker.validated(result(1, []))  # found nothing: dismissed
    run(healthy * 8)
    reported([0.33] * 4, 3.0)
    assert tracker.validation_wanted() == [3]


def test_a_pass_answers_only_the_reports_whose_steps_bore_them_out() -> None:
    """Node 3's steps bear its report out and a pass is asked for it; node 6's rise is still within its
    noise when the pass comes back empty. The pass dismisses node 3's report, not node 6's: that one waits
    for its own steps, and a pass of its own."""
    spec = FailSlowSpec(
        slowdown_threshold=1.2, min_duration_s=0, overheads=StrategyOverheads(microbatch_s=1.0)
    )
    tracker = FailSlowTracker(spec)
    tracker.gate.new_generation(0, {})
    healthy = [0.09, 0.10, 0.11, 0.12, 0.13] * 8
    walls = {3: [*healthy, *[0.33] * 4], 6: [*healthy, *[0.135] * 4]}
    for index in range(len(healthy) + 4):
        step = index + 1
        for node in range(NODES):
            _waited(
                tracker, node, step, walls[node][index] if node in walls else healthy[index % len(healthy)]
            )
    last = len(healthy) + 4
    onset = {"baseline_s": 0.11, "onset_step": last - 3}
    for node, slowdown in ((3, 3.0), (6, 1.23)):
        late = report(node, last, slowdown, SlowKind.COMMUNICATION).model_copy(update=onset)
        tracker.report(late, now=float(last))
    assert tracker.validation_wanted() == [3]
    tracker.validation_sent(1, now=float(last))
    tracker.validated(result(1, []))
    assert 3 not in tracker.candidates and tracker.candidates[6].validated is None
    # The same pass, timed out instead, would have sent node 3 on alone.
    tracker.report(report(3, last, 3.0, SlowKind.COMMUNICATION).model_copy(update=onset))
    tracker.validation_sent(2, now=float(last))
    assert tracker.validation_timeout(now=float(last) + spec.validation_timeout_s)
    assert tracker.candidates[3].validated == () and tracker.candidates[6].validated is None


def rising_job(cause: str, rising: int = 8) -> tuple[FailSlowTracker, int, int]:
    """Eight nodes, 40 healthy steps (walls 0.09-0.13 s, compute ~0.05 s), then `rising` steps of walls
    1.45x with `cause`: the host (every node's compute up 1.4x, the reporter's own 1.15x), a link (no
    compute moves) or node 5's device (its compute 2.8x). Returns the tracker, the rise's first step and
    the last step."""
    spec = FailSlowSpec(
        slowdown_threshold=1.2, min_duration_s=0, overheads=StrategyOverheads(microbatch_s=1.0)
    )
    tracker = FailSlowTracker(spec)
    tracker.gate.new_generation(0, {})
    healthy = [0.09, 0.10, 0.11, 0.12, 0.13] * 8
    computes = [0.045, 0.05, 0.055, 0.05]
    rise = [0.16] * rising

    def compute(node: int, index: int) -> float:
        own = computes[(index + node) % len(computes)]
        since = index - len(healthy)
        if since < 0 or cause == "link":
            return own
        if cause == "device":
            return own * 2.8 if node == 5 else own
        return own * (1.15 if node == 3 else 1.4)  # the reporter's own compute rose least

    for index, wall in enumerate([*healthy, *rise]):
        step = index + 1
        for node in range(NODES):
            own = compute(node, index)
            tracker.observe(
                IterationRecord(
                    node=node, generation=0, step=step, seconds=wall, samples=4, sent_at=float(step),
                    compute_s=own, communication_s=wall - own,
                ),
                now=float(step),
            )  # fmt: skip
    return tracker, len(healthy) + 1, len(healthy) + len(rise)


def _waits(tracker: FailSlowTracker, node: int, onset: int, last: int) -> None:
    """`node` reports a communication slowdown of its steps since `onset`, and the tracker judges it."""
    update = {"onset_step": onset, "baseline_s": 0.11}
    tracker.report(
        report(node, last, 1.45, SlowKind.COMMUNICATION).model_copy(update=update), now=float(last)
    )
    tracker.tick(now=float(last))


@pytest.mark.parametrize("cause", ["host", "link", "device"])
def test_a_wait_the_nodes_compute_rose_with_is_the_hosts_and_asks_for_no_pass(cause: str) -> None:
    """In 20 healthy minutes of the demo job at threshold 1.2 on two cores, 9 episodes opened on
    communication reports that the host's blips made: every node's steps and compute rose together for a
    few steps (the compute a median 1.2-1.5x), the reporter's own compute less than its detector's 25%, so
    it reported a wait; a pass then timed some link slow by chance. Such a report is dismissed. A slow link
    lengthens the waits and not the work, and a slow device the work of one node: both are validated."""
    tracker, onset, last = rising_job(cause)
    _waits(tracker, 3, onset, last)
    dismissed = [f.message for f in tracker.drain_findings() if f.kind is FindingKind.DISMISSED]
    if cause != "host":
        assert tracker.job.compute_rise(onset, last) == pytest.approx(1.0, abs=0.06)
        assert tracker.validation_wanted() == [3] and not dismissed, dismissed
        return
    assert tracker.job.compute_rise(onset, last) == pytest.approx(1.4, rel=0.1)
    assert tracker.validation_wanted() is None and 3 not in tracker.candidates
    assert any("node 3" in m and "machine-wide" in m and "1.40x" in m for m in dismissed), dismissed


def test_a_slow_link_that_came_with_a_host_blip_is_the_job_level_triggers_once_the_blip_is_over() -> None:
    tracker, onset, last = rising_job("host", rising=4)
    _waits(tracker, 3, onset, last)
    assert tracker.validation_wanted() is None and 3 not in tracker.candidates  # the work rose with it
    steps = iter(range(last + 1, last + 100))
    waited = 0
    while tracker.validation_wanted() is None and waited < 40:
        number = next(steps)
        for node in range(NODES):
            _waited(tracker, node, number, 0.16)  # the waits go on, the work is back
        tracker.tick(now=float(number))
        waited += 1
    # The job's step stays 1.45x: Falcon's trigger on it asks for the pass the report did not.
    print(f"asked for a pass {waited} steps after the report")
    assert tracker.validation_wanted() is not None and waited < 40, waited
    assert [c.job_level for c in tracker.candidates.values()] == [True]


def test_the_job_level_triggers_own_report_and_one_of_another_generation_are_not_held() -> None:
    """The job-level trigger judged the nodes' compute itself (every node's rise, `_localize`); a report of
    a generation whose compute the trigger does not keep has nothing to be judged by."""
    tracker, onset, last = rising_job("host")
    update = {"onset_step": onset, "baseline_s": 0.11}
    mine = report(3, last, 1.45, SlowKind.COMMUNICATION).model_copy(update=update)
    tracker.candidates[3] = Candidate(mine, float(last), job_level=True)
    tracker.report(mine.model_copy(update={"node": 4, "generation": 1}), now=float(last))
    tracker.tick(now=float(last))
    assert tracker.validation_wanted() == [3, 4]
    # And a restart keeps where a candidate came from.
    restored = FailSlowTracker(tracker.spec)
    restored.restore(json.loads(json.dumps(tracker.state())))
    assert restored.candidates[3].job_level and not restored.candidates[4].job_level


def test_a_report_ahead_of_the_other_nodes_records_waits_for_them_before_a_pass() -> None:
    """Judged before the other nodes' records of its latest steps were in, 25 reports asked for a pass in
    20 healthy minutes at 1.2 and were dismissed as the host's milliseconds later, the pass out (training
    held ~0.5 s each): a report waits for them, and a job whose nodes report no compute does not wait."""
    tracker, onset, last = rising_job("host", rising=2)
    # The reporter's records of 4 more steps of the blip come first: its steps bear its report out, and
    # the other nodes' compute has too few steps since the onset to be judged.
    for step in range(last + 1, last + 5):
        tracker.observe(
            IterationRecord(
                node=3, generation=0, step=step, seconds=0.16, samples=4, sent_at=float(step),
                compute_s=0.058, communication_s=0.102,
            ),
            now=float(step),
        )  # fmt: skip
    _waits(tracker, 3, onset, last + 4)
    assert tracker.job.compute_rise(onset, last + 4) is None and tracker.job.behind(last + 4)
    assert tracker.validation_wanted(now=float(last + 4)) is None and 3 in tracker.candidates
    for step in range(last + 1, last + 5):  # the others' records of those steps
        for node in set(range(NODES)) - {3}:
            tracker.observe(
                IterationRecord(
                    node=node, generation=0, step=step, seconds=0.16, samples=4, sent_at=float(step),
                    compute_s=0.07, communication_s=0.09,
                ),
                now=float(step),
            )  # fmt: skip
    tracker.tick(now=float(last + 4))
    assert not tracker.job.behind(last + 4) and 3 not in tracker.candidates  # the host's, and no pass
    dismissed = [f.message for f in tracker.drain_findings() if f.kind is FindingKind.DISMISSED]
    assert any("node 3" in m and "machine-wide" in m for m in dismissed), dismissed

    # Without compute in the records there is nothing to wait for: the pass is asked.
    tracker = FailSlowTracker(tracker.spec)
    for step in range(1, 50):
        for node in range(NODES):
            wall = 0.11 if step < 41 else 0.16
            tracker.observe(
                IterationRecord(
                    node=node, generation=0, step=step, seconds=wall, samples=4, sent_at=float(step)
                ),
                now=float(step),
            )
    assert not tracker.job.behind(49)
    _waits(tracker, 3, 41, 49)
    wanted = tracker.validation_wanted()
    assert wanted is not None and 3 in wanted  # (with the job-level trigger's own report, node 0's)
