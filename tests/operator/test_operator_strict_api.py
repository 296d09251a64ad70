"""The operator against an API server that behaves as a real one where it changes outcomes: a manifest the
CRD's CEL rules refuse never reaches the operator; a default the CRD's schema fills in is what the operator
handles; a deleted job's pods go (the operator's finalizer, then garbage collection by owner); and after the
server expires every watch (410 Gone, as after an etcd compaction) the operator lists again and still
handles a failure."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from _rjob_stack import (
    NAMESPACE,
    Kube,
    Operator,
    Stack,
    api_server,
    emulator_only,
    eventually,
    job_manifest,
    redis_client,
)

from resilientjob.localstack.emulator import LocalApiServer
from resilientjob.operator._manifests import job_label, pod_name, service_name
from resilientjob.operator.api import PLURAL
from resilientjob.operator.names import dns1035_errors, label_errors, subdomain_errors

pytestmark = pytest.mark.cluster
LAST_HANDLED = "resilientjob.io/last-handled-configuration"  # kopf's diff-base (operator/handlers.py)


async def generation(kube: Kube, job: str, number: int) -> dict[str, Any] | None:
    status = await kube.job_status(job)
    return status if status.get("planGeneration") == number else None


async def test_a_manifest_the_cel_rules_refuse_never_reaches_the_operator(stack: Stack) -> None:
    kube = stack.kube
    error = await kube.create_job(job_manifest("refused", faultTolerance=4))
    assert error is not None and error.status == 422 and "spec.faultTolerance" in str(error)
    # A valid job is handled meanwhile, so the operator was watching when the refused one was sent.
    assert await kube.create_job(job_manifest("accepted")) is None
    await eventually(lambda: generation(kube, "accepted", 0), 20, "the valid job planned")
    assert await kube.get(PLURAL, "refused") is None
    assert await kube.events_of("refused") == [] and await kube.job_pods("refused") == []


async def test_the_operator_sees_the_schemas_defaults(stack: Stack) -> None:
    kube = stack.kube
    manifest = job_manifest("defaulted", faultTolerance=None, failSlow={})
    assert await kube.create_job(manifest) is None
    await eventually(lambda: generation(kube, "defaulted", 0), 20, "generation 0")
    body = await kube.get(PLURAL, "defaulted")
    assert body is not None
    # kopf records the spec it handled: the server's defaults are in it, though the manifest had none.
    handled = json.loads(body["metadata"]["annotations"][LAST_HANDLED])["spec"]
    assert handled["faultTolerance"] == 1 and handled["policy"] == "auto"
    assert handled["failSlow"]["slowdownThreshold"] == 1.1 and handled["failSlow"]["enabled"] is True


async def test_a_simulated_job_is_not_warned_of_node_local_checkpoints(stack: Stack) -> None:
    """The synthetic loop trains no model and writes no checkpoint: a job of it without a checkpoint volume
    loses nothing on a restart, and is not told it does (a job that trains is: test_profile_from_pod)."""
    kube = stack.kube
    assert await kube.create_job(job_manifest("node-local")) is None
    await eventually(lambda: generation(kube, "node-local", 0), 20, "node-local planned")

    async def planned_event() -> bool:
        return "Planned" in [e.get("reason") for e in await kube.events_of("node-local")]

    # The warning would be posted right after the Planned Event, from the same queue.
    await eventually(planned_event, 10, "the Planned event")
    await asyncio.sleep(1.0)
    assert "CheckpointNodeLocal" not in [e.get("reason") for e in await kube.events_of("node-local")]


async def test_a_deleted_jobs_pods_disappear(stack: Stack) -> None:
    kube = stack.kube
    assert await kube.create_job(job_manifest("gone")) is None
    await eventually(lambda: generation(kube, "gone", 0), 20, "generation 0")
    assert len(await kube.job_pods("gone")) == 4
    assert await kube.delete(PLURAL, "gone")

    async def remaining() -> str | None:
        job = await kube.get(PLURAL, "gone")
        pods = [p["metadata"]["name"] for p in await kube.list("pods", "resilientjob.io/job=gone")]
        return f"job: {(job or {}).get('metadata')}, pods: {pods}" if job or pods else None

    async def collected() -> str | None:
        return "gone" if await remaining() is None else None

    # Generous: on a loaded machine kopf takes a while to stop the job's daemon before it lets the job go.
    try:
        await eventually(collected, 60, "the job and its pods gone")
    except AssertionError:
        raise AssertionError(f"still there after 60 s: {await remaining()}") from None
    assert (
        await kube.get("services", "gone-workers") is None
        and await kube.get("configmaps", "gone-plan") is None
    )
    redis = await redis_client(stack.redis_url)
    try:
        assert [key async for key in redis.scan_iter(match=f"{stack.keys('gone').prefix}*")] == []
    finally:
        await redis.aclose()


async def test_a_job_applied_again_at_once_waits_for_the_deleted_ones_pods(stack: Stack) -> None:
    """Delete a job and apply it again (the way to change a spec): the first job's pods take their grace
    period to go (a finalizer holds one here). The new job must not take that Terminating pod for its own
    (it fenced every node of generation 0 and failed); it waits, says so, and starts once the pod is gone."""
    kube = stack.kube
    assert await kube.create_job(job_manifest("again")) is None
    await eventually(lambda: generation(kube, "again", 0), 20, "the first job's generation 0")
    first_uid = ((await kube.get(PLURAL, "again")) or {})["metadata"]["uid"]
    held = kube.path("pods", "again-node-1")
    await kube.api.patch(held, {"metadata": {"finalizers": ["test.resilientjob.io/hold"]}})
    assert await kube.delete(PLURAL, "again")

    async def job_gone() -> bool:
        return await kube.get(PLURAL, "again") is None

    await eventually(job_gone, 60, "the first job deleted")
    assert await kube.create_job(job_manifest("again")) is None

    async def waiting() -> list[dict[str, Any]] | None:
        events = [e for e in await kube.events_of("again") if e.get("reason") == "WaitingForEarlierJob"]
        return events or None

    told = (await eventually(waiting, 20, "the WaitingForEarlierJob event"))[0]
    assert "pod/again-node-1" in told["message"], told
    await asyncio.sleep(1.0)
    status = await kube.job_status("again")
    assert status.get("planGeneration", -1) <= 0 and not status.get("fencedNodes"), status
    await kube.api.patch(held, {"metadata": {"finalizers": None}})
    planned = await eventually(lambda: generation(kube, "again", 0), 30, "the new job's generation 0")
    assert planned.get("phase") != "Failed" and not planned.get("fencedNodes"), planned
    new_uid = ((await kube.get(PLURAL, "again")) or {})["metadata"]["uid"]
    pods = await kube.job_pods("again")
    assert new_uid != first_uid and len(pods) == 4
    assert {p["metadata"]["ownerReferences"][0]["uid"] for p in pods} == {new_uid}


async def test_an_earlier_jobs_orphaned_objects_are_waited_for_not_taken(stack: Stack) -> None:
    """`kubectl delete --cascade=orphan` leaves the job's pods and ConfigMaps running with no owner. The job
    applied again under the name took them for its own (its first decision fenced the old agents). It waits
    for them instead, and says with a Warning which to delete, as nothing else will."""
    kube = stack.kube
    assert await kube.create_job(job_manifest("orph")) is None
    await eventually(lambda: generation(kube, "orph", 0), 20, "the first job's generation 0")
    status, _ = await kube.api._request(
        "DELETE", kube.path(PLURAL, "orph"), body={"propagationPolicy": "Orphan"}
    )
    assert status in (200, 202)

    async def orphaned() -> list[dict[str, Any]] | None:
        if await kube.get(PLURAL, "orph") is not None:
            return None
        pods = await kube.job_pods("orph")
        return pods if pods and not any(p["metadata"].get("ownerReferences") for p in pods) else None

    pods = await eventually(orphaned, 60, "the first job gone, its pods orphaned")
    assert await kube.create_job(job_manifest("orph")) is None

    async def warned() -> list[dict[str, Any]] | None:
        events = [e for e in await kube.events_of("orph") if e.get("reason") == "WaitingForEarlierJob"]
        return events or None

    told = (await eventually(warned, 20, "the WaitingForEarlierJob warning"))[0]
    assert told["type"] == "Warning" and "--cascade=orphan" in told["message"], told
    command = told["message"].split("`")[1]
    # How many it waits for says the same as how many of them are orphans (it named 4, then "6 of them").
    listed = int(told["message"].split("deleted: ")[1].split()[0])
    assert f"; {listed} of them orphaned" in told["message"] and listed == len(command.split()[4:]), told
    assert command.startswith("kubectl delete -n ") and "configmap/orph-plan" in command, command
    assert all(f"pod/{p['metadata']['name']}" in command for p in pods), command
    await asyncio.sleep(1.0)
    status_now = await kube.job_status("orph")
    assert status_now.get("planGeneration", -1) < 0 and not status_now.get("fencedNodes"), status_now
    # Said in the status too, which outlives the Event: the job would wait for ever.
    planned_condition = next(c for c in status_now["conditions"] if c["type"] == "Planned")
    assert planned_condition["status"] == "False" and planned_condition["reason"] == "WaitingForEarlierJob"
    assert command in planned_condition["message"]

    # What the Warning says to run.
    for name in command.split()[4:]:
        plural = {"pod": "pods", "configmap": "configmaps", "service": "services"}[name.split("/")[0]]
        await kube.api.delete(kube.path(plural, name.split("/")[1]), grace_period_s=0)
    planned = await eventually(lambda: generation(kube, "orph", 0), 30, "the new job's generation 0")
    assert planned.get("phase") != "Failed" and not planned.get("fencedNodes"), planned
    new_uid = ((await kube.get(PLURAL, "orph")) or {})["metadata"]["uid"]
    assert {p["metadata"]["ownerReferences"][0]["uid"] for p in await kube.job_pods("orph")} == {new_uid}


@pytest.fixture
def short_leftover_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator (started by `stack` after this) force-deletes an earlier job's stuck pods after 2 s."""
    monkeypatch.setenv("RJOB_LEFTOVER_GRACE_S", "2")


async def test_an_earlier_jobs_pod_stuck_terminating_is_force_deleted_after_the_grace(
    short_leftover_grace: None, stack: Stack
) -> None:
    """The earlier job's pod was on a node that is gone: deleted, it stays Terminating for ever, as no
    kubelet confirms it (the API server keeps a bound pod until one does). The job applied again under the
    name would wait for it for ever; past its grace period by `RJOB_LEFTOVER_GRACE_S` it is force-deleted,
    said in an Event, and the job starts."""
    kube = stack.kube
    assert await kube.create_job(job_manifest("late")) is None
    await eventually(lambda: generation(kube, "late", 0), 20, "the first job's generation 0")
    pod = kube.path("pods", "late-node-1")
    # Bound to a node that no kubelet serves any more, with a short grace period.
    await kube.api.patch(pod, {"spec": {"nodeName": "lost-node", "terminationGracePeriodSeconds": 1}})
    assert await kube.delete(PLURAL, "late")

    async def job_gone() -> bool:
        return await kube.get(PLURAL, "late") is None

    await eventually(job_gone, 60, "the first job deleted")
    stuck = await kube.get("pods", "late-node-1")
    assert stuck and stuck["metadata"].get("deletionTimestamp"), stuck  # Terminating, and stays so
    assert await kube.create_job(job_manifest("late")) is None
    planned = await eventually(lambda: generation(kube, "late", 0), 30, "generation 0 after the grace")
    assert planned.get("phase") != "Failed" and not planned.get("fencedNodes"), planned
    new_uid = ((await kube.get(PLURAL, "late")) or {})["metadata"]["uid"]
    assert {p["metadata"]["ownerReferences"][0]["uid"] for p in await kube.job_pods("late")} == {new_uid}

    async def told() -> list[str] | None:
        # kopf posts Events from a queue: they may lag a moment behind the status.
        events = [e for e in await kube.events_of("late") if e.get("reason") == "WaitingForEarlierJob"]
        messages = [e["message"] for e in events]
        return messages if any("force-deleted pod/late-node-1" in m for m in messages) else None

    await eventually(told, 10, "the Event saying the stuck pod was force-deleted")


async def test_a_job_whose_redis_is_unreachable_is_deleted_without_a_long_wait(stack: Stack) -> None:
    # Redis is a channel, not the job's record: its clean-up gets a few short retries (FORGET_ATTEMPTS x
    # FORGET_RETRY_DELAY_S, about 8 s), not kopf's default minute per retry, and then lets the job go.
    kube = stack.kube
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    assert (
        await kube.create_job(job_manifest("stranded", redis={"url": f"redis://127.0.0.1:{closed}/0"}))
        is None
    )

    async def finalized() -> bool:
        job = await kube.get(PLURAL, "stranded")
        return bool(job and job["metadata"].get("finalizers"))

    await eventually(finalized, 20, "the operator's finalizer on the job")
    assert await kube.delete(PLURAL, "stranded")

    async def gone() -> bool:
        return await kube.get(PLURAL, "stranded") is None

    await eventually(gone, 30, "the job gone though its Redis never answered")


@pytest.fixture
async def expiring(redis_url: str, tmp_path: Path) -> AsyncIterator[tuple[LocalApiServer, Kube, Operator]]:
    async with api_server() as (emulator, url):
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True, default_namespace=NAMESPACE))
        operator = Operator(url, redis_url, tmp_path / "operator.log")
        operator.start()
        try:
            yield emulator, kube, operator
        finally:
            operator.stop()
            await kube.close()


@emulator_only("expiring every watch on demand is the local API server's test hook")
async def test_the_operator_copes_with_expired_watches(
    expiring: tuple[LocalApiServer, Kube, Operator],
) -> None:
    emulator, kube, operator = expiring
    assert await kube.create_job(job_manifest("expiry")) is None
    await eventually(lambda: generation(kube, "expiry", 0), 20, "generation 0")
    await emulator.expire_watches()
    # Events the operator can only see through watches started anew after the 410.
    await kube.delete("pods", "expiry-node-2")
    status = await eventually(lambda: generation(kube, "expiry", 1), 20, "generation 1 after the expiry")
    assert status["failedNodes"] == [2]
    assert await kube.create_job(job_manifest("after")) is None
    await eventually(lambda: generation(kube, "after", 0), 20, "a job created after the expiry planned")
    assert operator.process is not None and operator.process.poll() is None


async def test_a_valid_long_job_name_gives_valid_child_names(stack: Stack) -> None:
    """The longest names a job may have (253 characters, dots allowed) still give valid pods (a pod's name is
    its hostname: a DNS label), a valid Service (DNS-1035) and valid label values: the server refuses
    nothing the operator creates, and the job is handled through them."""
    kube = stack.kube
    name = ("x" + "-long" * 60)[:249] + ".j-1"
    assert len(name) == 253 and not subdomain_errors(name)
    assert await kube.create_job(job_manifest(name)) is None
    await eventually(lambda: generation(kube, name, 0), 30, "generation 0 of the long-named job")
    pods = await kube.list("pods", f"resilientjob.io/job={job_label(name)}")
    assert len(pods) == 4
    for pod in pods:
        assert (
            not label_errors(pod["metadata"]["name"]) and pod["spec"]["hostname"] == pod["metadata"]["name"]
        )
        assert not dns1035_errors(pod["spec"]["subdomain"])
    assert await kube.get("services", service_name(name)) is not None
    await kube.delete("pods", pod_name(name, 1))
    status = await eventually(lambda: generation(kube, name, 1), 20, "generation 1 after a pod deletion")
    assert status["failedNodes"] == [1]
