"""Capacity comes back, through the real operator against the emulated API server and a real Redis: two
workers die, their places get new pods under fresh node ids, the new pods join through the planner once they
run (this test plays the kubelet: it sets the pods' phases), and a replacement that keeps failing is asked
for again with a growing, bounded delay that the status and the Events show."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from _rjob_stack import Kube, Stack, emulator_only, eventually, job_manifest, set_pod_phase

pytestmark = [
    pytest.mark.cluster,
    emulator_only("the test sets pod phases itself, as the kubelet of a real cluster would"),
]

StatusWhere = Callable[[Callable[[dict[str, Any]], bool]], Awaitable[dict[str, Any] | None]]
BACKOFF_S = 1.0
BACKOFF_MAX_S = 2.0


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator (started by `stack` after this) backs off 1 s, then 2 s at most."""
    monkeypatch.setenv("RJOB_REPLACE_BACKOFF_S", str(BACKOFF_S))
    monkeypatch.setenv("RJOB_REPLACE_BACKOFF_MAX_S", str(BACKOFF_MAX_S))


async def _nodes(kube: Kube, job: str) -> dict[int, dict[str, Any]]:
    return {int(pod["metadata"]["labels"]["resilientjob.io/node"]): pod for pod in await kube.job_pods(job)}


async def _started(kube: Kube, job: str, **spec: Any) -> tuple[dict[str, Any], StatusWhere]:
    """Create `job` (fail-slow off: a noisy shared CPU must not add generations), wait for its generation 0
    and run its four pods as a kubelet would; its status then, and a reader of its status that answers once
    a check holds."""
    await kube.create_job(job_manifest(job, failSlow={"enabled": False}, **spec))

    async def status_where(check: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        status = await kube.job_status(job)
        return status if status and check(status) else None

    first = await eventually(lambda: status_where(lambda s: s.get("planGeneration") == 0), 20, "generation 0")
    for node in range(4):
        await set_pod_phase(kube, f"{job}-node-{node}", "Running")
    return first, status_where


async def test_two_killed_workers_come_back_as_new_nodes_and_a_crash_loop_backs_off(
    fast_backoff: None, stack: Stack
) -> None:
    kube = stack.kube
    first, status_where = await _started(kube, "grow")
    assert first["workersTotal"] == 4

    # Two workers die at once: fenced, planned around, and two pods asked for under new ids 4 and 5.
    await kube.delete("pods", "grow-node-1")
    await kube.delete("pods", "grow-node-2")
    shrunk = await eventually(
        lambda: status_where(lambda s: sorted(s.get("failedNodes", [])) == [1, 2]), 10, "nodes 1, 2 out"
    )
    assert shrunk["workersTotal"] == 2

    async def replacements() -> dict[int, dict[str, Any]] | None:
        pods = await _nodes(kube, "grow")
        return pods if sorted(pods) == [0, 3, 4, 5] else None

    pods = await eventually(replacements, 10, "replacement pods for nodes 4 and 5")
    assert all((pods[n].get("status") or {}).get("phase", "Pending") == "Pending" for n in (4, 5))
    assert all("resilientjob.io/strikes" not in pods[n]["metadata"]["annotations"] for n in (4, 5))

    # They run: the planner takes them in (a scale-up chosen by eq. 8), and the layout grows back. Node 4
    # runs first and waits for node 5, still starting: one generation takes both in, not one each.
    await set_pod_phase(kube, "grow-node-4", "Running")
    await asyncio.sleep(1.5)
    assert (await kube.job_status("grow"))["planGeneration"] == shrunk["planGeneration"]
    await set_pod_phase(kube, "grow-node-5", "Running")
    grown = await eventually(
        lambda: status_where(lambda s: s.get("workersTotal") == 4 and s.get("workers") == "4/4"),
        15,
        "the layout grown back to four workers",
    )
    decision = grown["lastDecision"]
    joined = [r["nodes"] for r in grown.get("recoveries") or [] if r["trigger"] == "NodeJoined"]
    assert decision["trigger"] == "NodeJoined" and joined == [[4, 5]], grown.get("recoveries")
    assert grown["planGeneration"] == shrunk["planGeneration"] + 1
    # The planner's choice: the best score, then the shortest transition (policies often tie on a layout).
    feasible = [c for c in decision["candidates"] if c["feasible"]]
    top = max(c["score"] for c in feasible)
    best = min((c for c in feasible if c["score"] == top), key=lambda c: c["transitionS"])
    chosen = [c for c in feasible if (c["policy"], c["layout"]) == (decision["policy"], decision["layout"])]
    assert chosen and chosen[0]["score"] == top and chosen[0]["transitionS"] == best["transitionS"], feasible
    plan = json.loads((await kube.get("configmaps", "grow-plan"))["data"]["plan.json"])  # type: ignore[index]
    used = {s["node"] for p in plan["plan"]["pipelines"] for s in p["stages"] if not s["rerouted_to"]}
    assert used == {0, 3, 4, 5}
    assert {c["type"]: c["status"] for c in grown["conditions"]}["Degraded"] == "False"
    generations = [r["generation"] for r in grown["recoveries"]]
    assert generations == sorted(set(generations)) and generations[-1] == grown["planGeneration"]

    # Node 5 crashes soon after it started: replaced at once (strike 1), its replacement crashes before it
    # ever runs (strike 2: waits 1 s), and the next (strike 3: waits 2 s, the bound), and so on.
    await set_pod_phase(kube, "grow-node-5", "Failed")
    created: dict[int, float] = {}
    failed_at: dict[int, float] = {}
    node = 5
    for strikes in (1, 2, 3):
        failed_at[node] = time.monotonic()

        async def next_pod(after: int = node) -> dict[str, Any] | None:
            pods = await _nodes(kube, "grow")
            return next((pod for n, pod in pods.items() if n > after), None)

        pod = await eventually(next_pod, 10, f"the replacement after {strikes} quick failure(s)")
        new = int(pod["metadata"]["labels"]["resilientjob.io/node"])
        created[new] = time.monotonic()
        assert new == node + 1  # a fresh id each time, never one seen before
        assert pod["metadata"]["annotations"]["resilientjob.io/strikes"] == str(strikes)
        if strikes >= 2:
            waited = created[new] - failed_at[node]
            expected = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (strikes - 2))
            assert waited >= expected - 0.05, (strikes, waited)
        node = new
        if strikes < 3:
            await set_pod_phase(kube, f"grow-node-{node}", "Failed")
    status = await kube.job_status("grow")
    assert status["capacity"]["nextNodeId"] == node + 1
    assert status["capacity"]["replaced"] == 5

    async def all_events() -> list[str] | None:
        # kopf posts Events from a queue: the last ones may lag a moment behind the pods.
        reasons = [e.get("reason", "") for e in await kube.events_of("grow")]
        return reasons if reasons.count("NodeReplaced") == 5 else None

    reasons = await eventually(all_events, 5, "an Event for each of the five replacements")
    waits = [e["message"] for e in await kube.events_of("grow") if e.get("reason") == "ReplacementBackoff"]
    assert len(waits) == 2 and all("in a row soon after starting" in m for m in waits), waits
    assert "NodeJoined" in reasons
    # The crash-looping pods never held a stage: a failure outside the plan costs no generation.
    assert status["planGeneration"] == grown["planGeneration"] + 1  # only node 5's own fencing


async def test_a_join_the_planner_declines_publishes_no_generation(stack: Stack) -> None:
    """`policy: reroute` keeps the layout when a node joins: the replacement stays idle. Publishing the same
    layout again would make every worker rendezvous for nothing; the decision is in the status instead."""
    kube = stack.kube
    _, status_where = await _started(kube, "idle", policy="reroute")
    await kube.delete("pods", "idle-node-1")
    shrunk = await eventually(
        lambda: status_where(lambda s: s.get("failedNodes") == [1]), 10, "node 1 out, rerouted"
    )
    generation = shrunk["planGeneration"]
    await eventually(lambda: _nodes(kube, "idle"), 10, "pods")

    async def replacement() -> dict[str, Any] | None:
        return (await _nodes(kube, "idle")).get(4)

    await eventually(replacement, 10, "a replacement pod for node 1 under id 4")
    await set_pod_phase(kube, "idle-node-4", "Running")

    declined = await eventually(
        lambda: status_where(lambda s: (s.get("lastDecision") or {}).get("trigger") == "NodeJoined"),
        10,
        "the join decided",
    )
    decision = declined["lastDecision"]
    assert decision["nodes"] == [4] and decision["generation"] == generation, decision
    assert decision["policy"] == "reroute" and "joined nodes idle" in decision["reason"], decision
    # Several passes later the join is still decided, not asked again, and no generation came of it.
    later = await _settled(kube, "idle", seconds=1.5)
    assert later["planGeneration"] == generation, later.get("recoveries")
    assert not [r for r in later.get("recoveries") or [] if r["trigger"] == "NodeJoined"]
    plan = json.loads((await kube.get("configmaps", "idle-plan"))["data"]["plan.json"])  # type: ignore[index]
    assert plan["generation"] == generation
    messages = [e["message"] for e in await kube.events_of("idle") if e.get("reason") == "NodeJoined"]
    assert len(messages) == 1 and "nodes [4] stay idle" in messages[0], messages


async def _settled(kube: Kube, job: str, seconds: float) -> dict[str, Any]:
    """The job's status after `seconds` of the operator's passes."""
    await asyncio.sleep(seconds)
    status = await kube.job_status(job)
    assert status is not None
    return status


async def test_a_job_that_lost_every_node_at_once_restarts_on_its_replacements(stack: Stack) -> None:
    """A spot reclaim of the whole job: every worker pod goes at once. Nobody survives to plan around, and
    the planner alone would fail the job (and leave the replacements holding devices); it waits for them
    and restarts from its checkpoint on them."""
    kube = stack.kube
    _, status_where = await _started(kube, "reclaimed")
    # All at once, as the operator sees it: deleted one by one under its eyes, the last one could still be
    # planned on alone. The operator is down meanwhile, as it may well be when a whole node pool goes.
    stack.operator.kill()
    for node in range(4):
        await kube.delete("pods", f"reclaimed-node-{node}")
    stack.operator.start()

    async def replacements() -> dict[int, dict[str, Any]] | None:
        pods = await _nodes(kube, "reclaimed")
        return pods if sorted(pods) == [4, 5, 6, 7] else None

    await eventually(replacements, 15, "four replacement pods under new ids")
    # The scheduler finds no room for one of them: the wait says so where a user looks.
    unschedulable = "0/3 nodes are available: 3 Insufficient cpu."
    scheduling = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    await kube.api.patch(
        kube.path("pods", "reclaimed-node-5", status=True),
        {"status": {"phase": "Pending", "conditions": [{**scheduling, "message": unschedulable}]}},
    )

    def planned(status: dict[str, Any]) -> dict[str, Any]:
        return next(c for c in status.get("conditions", []) if c["type"] == "Planned")

    waiting = await eventually(
        lambda: status_where(lambda s: "cannot be scheduled" in planned(s)["message"]),
        10,
        "the Planned condition naming the replacement the scheduler cannot place",
    )
    assert waiting.get("phase") != "Failed" and waiting.get("planGeneration") == 0, waiting
    condition = planned(waiting)
    assert (condition["status"], condition["reason"]) == ("False", "WaitingForReplacements"), condition
    assert "every node of generation 0 failed" in condition["message"], condition
    assert "node 5 cannot be scheduled: 0/3 nodes are available: 3 Insufficient cpu" in condition["message"]
    assert waiting["capacity"]["wholeJobLoss"] == {"generation": 0, "step": 0, "inARow": 1}, waiting

    async def told() -> list[dict[str, Any]] | None:
        # kopf posts Events from a queue: they may lag a moment behind the status.
        events = await kube.events_of("reclaimed")
        return [e for e in events if e.get("reason") == "WaitingForReplacements"] or None

    events = await eventually(told, 5, "the WaitingForReplacements Event")
    assert len(events) == 1 and events[0]["type"] == "Warning", events
    for node in range(4, 8):
        await set_pod_phase(kube, f"reclaimed-node-{node}", "Running")
    restarted = await eventually(
        lambda: status_where(lambda s: s.get("planGeneration", 0) >= 1),
        30,
        "a generation on the replacements",
    )
    assert restarted.get("phase") != "Failed", restarted
    assert planned(restarted)["status"] == "True", restarted
    recovery = restarted["recoveries"][-1]
    assert recovery["policy"] == "checkpoint" and sorted(restarted["failedNodes"]) == [0, 1, 2, 3], restarted
    plan = json.loads((await kube.get("configmaps", "reclaimed-plan") or {})["data"]["plan.json"])
    assert sorted({s["node"] for p in plan["plan"]["pipelines"] for s in p["stages"]}) == [4, 5, 6, 7]


async def test_a_job_whose_every_worker_keeps_crashing_at_the_same_step_ends(
    fast_backoff: None, stack: Stack
) -> None:
    """A bug that crashes every worker at the same step: each restart from the checkpoint meets it again.
    The job restarts `checkpoint.restartLimit` times, then fails naming the field and the crash, and its
    pods go; it does not loop for ever (its pods holding devices)."""
    kube = stack.kube
    _, status_where = await _started(kube, "crashing", checkpoint={"restartLimit": 1})
    crash = "ZeroDivisionError: division by zero (in the user's loss)"

    async def crash_all(nodes: range) -> None:
        for node in nodes:
            status = {
                "phase": "Failed",
                "reason": "Error",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [
                    {"name": "worker", "state": {"terminated": {"exitCode": 1, "message": crash}}}
                ],
            }
            await kube.api.patch(kube.path("pods", f"crashing-node-{node}", status=True), {"status": status})

    async def pods_are(nodes: range) -> dict[int, dict[str, Any]] | None:
        pods = await _nodes(kube, "crashing")
        return pods if sorted(pods) == list(nodes) else None

    # First loss: counted, replacements asked for, and the job restarts on them (restart 1 of 1).
    stack.operator.kill()  # all at once, as the operator sees it
    await crash_all(range(4))
    stack.operator.start()
    await eventually(lambda: pods_are(range(4, 8)), 15, "four replacements")
    for node in range(4, 8):
        await set_pod_phase(kube, f"crashing-node-{node}", "Running")
    restarted = await eventually(
        lambda: status_where(lambda s: s.get("planGeneration", 0) >= 1), 30, "the restart on them"
    )
    assert restarted["capacity"]["wholeJobLoss"]["inARow"] == 1, restarted
    assert restarted["phase"] != "Failed", restarted

    # They crash at the same step (no step committed past the first loss): one past the limit, it ends.
    stack.operator.kill()
    await crash_all(range(4, 8))
    stack.operator.start()
    ended = await eventually(
        lambda: status_where(lambda s: s.get("phase") == "Failed"), 20, "the job failed on the crash loop"
    )
    planned = next(c for c in ended["conditions"] if c["type"] == "Planned")
    assert planned["reason"] == "RestartLimitExceeded", planned
    assert planned["message"].startswith("checkpoint.restartLimit: every node failed 2 times in a row")
    assert crash in planned["message"], planned
    assert ended["capacity"]["wholeJobLoss"]["inARow"] == 2, ended

    async def no_pods() -> bool:
        return not await _nodes(kube, "crashing")

    await eventually(no_pods, 15, "every worker pod deleted")

    async def told() -> list[str] | None:
        # kopf posts Events from a queue: the last ones may lag a moment behind the status.
        reasons = [e.get("reason", "") for e in await kube.events_of("crashing")]
        return reasons if "RestartLimitExceeded" in reasons else None

    reasons = await eventually(told, 5, "the RestartLimitExceeded Event")
    assert reasons.count("WaitingForReplacements") == 1, reasons  # the second loss ended the job
