"""The pure decisions of capacity replacement (`operator/_capacity.py`): which new node ids the replacement
pods get (never one used before, also across an operator restart that reads the record back from the status),
how the crash-loop backoff grows and where it stops, and which ready pods count as joins."""

from __future__ import annotations

import pytest
from _support import bert_spec_fields

from resilientjob.operator import api
from resilientjob.operator._capacity import (
    Backoff,
    CapacityKeeper,
    after_failure,
    replacements,
    rfc3339,
    unix_time,
)
from resilientjob.operator._decide import (
    Observation,
    PodView,
    detect_joins,
    held_joins,
    new_joins,
    pod_view,
    same_work,
    starting_nodes,
)
from resilientjob.operator._manifests import ANNOTATION_STRIKES, LABEL_JOB, LABEL_NODE, job_label
from resilientjob.operator.api import parse_spec
from resilientjob.operator.planning import plan_initial, plan_next, planner_inputs
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan

NOW = 1_800_000_000.0


def _pod(
    node: int, *, ready: bool = True, phase: str = "Running", created: float = NOW - 5, strikes: int = 0
):
    return PodView(
        node=node,
        name=f"j-node-{node}",
        uid=f"uid-{node}",
        phase=phase,
        ready=ready,
        deleting=False,
        reason="",
        created=rfc3339(created),
        strikes=strikes,
    )


def _plan(nodes: list[int]) -> Plan:
    pipelines = tuple(
        PipelinePlan(stages=(StagePlan(layers=(0, 4), node=node, gpus=(0,)),), microbatches=2)
        for node in nodes
    )
    return Plan(policy=Policy.DYNAMIC, microbatch_size=1, pipelines=pipelines, step_time_s=1.0)


def test_backoff_grows_from_the_second_quick_failure_and_is_bounded() -> None:
    backoff = Backoff(base_s=10.0, max_s=300.0, stable_s=60.0)
    assert [backoff.delay_s(n) for n in range(8)] == [0, 0, 10, 20, 40, 80, 160, 300]
    assert backoff.delay_s(10_000) == 300.0  # no overflow however long the loop went on
    assert backoff.strikes(0, lived_s=3.0) == 1
    assert backoff.strikes(4, lived_s=59.9) == 5
    assert backoff.strikes(4, lived_s=60.0) == 0  # it ran: no crash loop, the count starts over
    assert backoff.strikes(4, lived_s=None) == 0  # deleted by hand, lifetime unknown: not a crash
    with pytest.raises(ValueError, match="backoff"):
        Backoff(base_s=10.0, max_s=5.0)


def test_after_failure_holds_the_replacement_by_the_strikes_the_pod_carried() -> None:
    backoff = Backoff(base_s=10.0, max_s=300.0, stable_s=60.0)
    empty = api.CapacityStatus()
    first = after_failure(empty, _pod(1, created=NOW - 5), NOW, backoff)
    assert first.waiting == [api.WaitingReplacement(strikes=1, not_before="")]  # at once
    third = after_failure(empty, _pod(7, created=NOW - 5, strikes=2), NOW, backoff)
    assert third.waiting[0].strikes == 3 and unix_time(third.waiting[0].not_before) == NOW + 20
    stable = after_failure(empty, _pod(7, created=NOW - 3600, strikes=5), NOW, backoff)
    assert stable.waiting[0].strikes == 0 and stable.waiting[0].not_before == ""
    gone = after_failure(empty, None, NOW, backoff)
    assert gone.waiting[0].strikes == 0


def test_replacements_get_fresh_ids_above_every_known_one_and_never_reuse_them() -> None:
    record = api.CapacityStatus()
    # Nodes 1 and 2 of four failed: two replacements at once, ids 4 and 5.
    record = after_failure(after_failure(record, _pod(1), NOW, Backoff()), _pod(2), NOW, Backoff())
    decided = replacements(record, target=4, live=2, known=[0, 3, 1, 2], now=NOW)
    assert decided.create == ((4, 1), (5, 1))
    assert decided.capacity.next_node_id == 6 and decided.capacity.replaced == 2
    assert decided.capacity.waiting == [] and decided.held == ()
    # An operator restart reads the record back from the status: node 5 failed and was deleted, so no
    # pod or plan shows ids 4..5 any more, and still the next id is 6.
    restored = api.parse_status(api.status_patch(api.ResilientJobStatus(capacity=decided.capacity))).capacity
    again = replacements(restored, target=4, live=3, known=[0, 3], now=NOW)
    assert again.create == ((6, 0),)
    # Without the record (status lost), ids still go above every one the job knows.
    blind = replacements(api.CapacityStatus(), target=4, live=3, known=[0, 3, 9], now=NOW)
    assert blind.create == ((10, 0),)
    # Nothing missing: nothing created, and the record only remembers the ids.
    full = replacements(restored, target=4, live=4, known=[0, 3, 4, 6], now=NOW)
    assert full.create == () and full.capacity.next_node_id == 7 and full.capacity.replaced == 2


def test_a_waiting_replacement_is_held_until_its_time_and_surplus_waits_are_dropped() -> None:
    backoff = Backoff(base_s=10.0, max_s=300.0, stable_s=60.0)
    record = after_failure(api.CapacityStatus(next_node_id=8), _pod(7, strikes=2), NOW, backoff)
    held = replacements(record, target=4, live=3, known=[0, 1, 2], now=NOW + 19)
    assert held.create == () and [w.strikes for w in held.held] == [3]
    assert held.capacity.waiting == record.waiting and held.capacity.next_node_id == 8
    due = replacements(record, target=4, live=3, known=[0, 1, 2], now=NOW + 20)
    assert due.create == ((8, 3),) and due.capacity.waiting == []
    # A pod came back by other means meanwhile: the wait is no longer needed.
    surplus = replacements(record, target=4, live=4, known=[0, 1, 2, 3], now=NOW)
    assert surplus.create == () and surplus.capacity.waiting == []
    # Two missing, one explained by the record (held), one not: the unexplained one goes at once.
    mixed = replacements(record, target=4, live=2, known=[0, 1], now=NOW)
    assert mixed.create == ((8, 0),) and len(mixed.held) == 1


def test_rfc3339_rounds_up_and_reads_back() -> None:
    assert rfc3339(NOW + 0.2) == rfc3339(NOW + 1)
    assert unix_time(rfc3339(NOW + 0.2)) == NOW + 1
    assert unix_time("") is None and unix_time("yesterday") is None


def test_joins_include_replacement_ids_beyond_spec_nodes_and_are_not_asked_twice() -> None:
    plan = _plan([0, 3])
    pods = {0: _pod(0), 3: _pod(3), 4: _pod(4), 5: _pod(5, ready=False, phase="Pending")}
    idle = detect_joins(plan, Observation(pods=pods, expired_heartbeats=frozenset()))
    assert idle == {4}  # ready and unused; node 5 is still Pending
    assert new_joins(idle, decided=[1, 2]) == {4}
    # The last generation already decided about node 4 (and left it idle): not a new join.
    assert new_joins(idle, decided=[4]) == set()


def test_joins_wait_for_replacements_still_starting_and_the_first_step_but_not_past_the_settle_time() -> None:
    plan = _plan([0, 3])
    pods = {
        0: _pod(0),
        3: _pod(3),
        4: _pod(4),
        5: _pod(5, ready=False, phase="Pending"),
        6: _pod(6, ready=False, phase="Failed"),
        7: _pod(7, ready=False, phase="Pending"),
    }
    observed = Observation(pods=pods, expired_heartbeats=frozenset())
    # Node 7 is parked by a fail-slow mitigation: it rejoins through its recovery report, not as a join.
    starting = starting_nodes(plan, observed, parked=[7])
    assert starting == {5}  # node 6 failed: nothing to wait for
    assert (
        held_joins(starting, stepped=4, generation=4, waited_s=2.0, settle_s=10.0)
        == "nodes [5] are still starting"
    )
    assert held_joins(set(), stepped=3, generation=4, waited_s=2.0, settle_s=10.0) == (
        "generation 4 has not committed a step yet"
    )
    assert held_joins(set(), stepped=4, generation=4, waited_s=2.0, settle_s=10.0) is None
    assert held_joins(set(), stepped=None, generation=4, waited_s=0.0, settle_s=10.0) is None  # unknown
    # Never past the settle time, and 0 turns the wait off.
    assert held_joins(starting, stepped=3, generation=4, waited_s=10.0, settle_s=10.0) is None
    assert held_joins(starting, stepped=3, generation=4, waited_s=0.0, settle_s=0.0) is None


def test_pod_view_reads_the_strikes_and_creation_time() -> None:
    pod = {
        "metadata": {
            "name": "j-node-6",
            "uid": "u",
            "creationTimestamp": "2027-01-15T08:00:00Z",
            "labels": {LABEL_JOB: job_label("j"), LABEL_NODE: "6"},
            "annotations": {ANNOTATION_STRIKES: "3"},
        },
        "status": {"phase": "Pending"},
    }
    view = pod_view(pod, "j")
    assert view is not None and view.node == 6 and view.strikes == 3
    assert view.created == "2027-01-15T08:00:00Z"
    pod["metadata"]["annotations"] = {ANNOTATION_STRIKES: "lots"}  # type: ignore[index]
    bad = pod_view(pod, "j")
    assert bad is not None and bad.strikes == 0


@pytest.mark.parametrize(("policy", "kept"), [("reroute", True), ("dynamic", False)])
def test_a_join_left_idle_gives_no_node_other_work(policy: str, kept: bool) -> None:
    spec = parse_spec(bert_spec_fields(policy=policy))
    inputs = planner_inputs(spec)
    shrunk = plan_next(spec, inputs, plan_initial(spec, inputs), failed=[1])
    grown = plan_next(spec, inputs, shrunk, joined=[4])
    assert same_work(shrunk, grown) is kept
    assert (4 in grown.nodes) is not kept
    assert not same_work(plan_initial(spec, inputs), shrunk)  # the failure itself moved work


def test_the_workers_measured_switch_goes_into_its_recovery_once() -> None:
    from resilientjob.operator._decide import measured_switches

    recoveries = [
        api.Recovery(generation=1, trigger=api.Reason.NODE_FAILED, policy="dynamic", layout="DP3 PP[1,1,1]"),
        api.Recovery(
            generation=2, trigger=api.Reason.NODE_JOINED, policy="dynamic", layout="DP4 PP[1,1,1,1]"
        ),
    ]
    updated = measured_switches(recoveries, {1: (0.04012, 0.081, 3 << 20), 7: (1.0, 1.0, 1)})
    assert updated is not None
    assert (updated[0].rendezvous_s, updated[0].copy_s, updated[0].copied_bytes) == (0.0401, 0.081, 3 << 20)
    assert updated[1] == recoveries[1]  # nothing reported for it (yet)
    assert measured_switches(updated, {1: (0.04012, 0.081, 3 << 20)}) is None  # unchanged: no status patch


@pytest.mark.parametrize("replace", [True, False])
def test_a_fence_records_a_waiting_replacement_only_where_one_will_come(replace: bool) -> None:
    """`status.capacity.waiting` of a job with `replaceFailedNodes: false` kept an entry per fence that no
    replacement would ever take off."""
    from types import SimpleNamespace

    spec = parse_spec(bert_spec_fields(replace_failed_nodes=replace))
    ctl = SimpleNamespace(pods={}, status=api.ResilientJobStatus(), require_spec=lambda: spec)
    CapacityKeeper().fenced(ctl, 2, now=1000.0)  # type: ignore[arg-type]
    assert len(ctl.status.capacity.waiting) == (1 if replace else 0)
