"""A job is its uid, not its name: a job deleted and applied again under the same name is another job, and
nothing of the first (its controller's caches, Redis client, training progress) may carry over; a job whose
name is longer than a label value still finds its own store pod."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import kopf
import pytest
from kopf._cogs.aiokits import aioenums

from resilientjob.operator import _lifecycle, _manifests, handlers
from resilientjob.operator._store import is_store_pod


class _Controller:
    """Stands in for `JobController`, which needs a Kubernetes API: the handler's bookkeeping is under
    test here (which controller a daemon gets, which ones it closes), not the controller."""

    made: ClassVar[list[_Controller]] = []
    failures = 0
    """How many of the next runs fail (as a run does while Redis is away: kopf restarts the daemon)."""

    def __init__(self, kube: Any, settings: Any, namespace: str, name: str, uid: str = "") -> None:
        self.uid, self.closed, self.runs, self.running = uid, False, 0, False
        _Controller.made.append(self)

    async def setup(self, body: Any) -> None:
        assert body["metadata"]["uid"] == self.uid, "a controller set up for another job"

    async def run(self, stopped: Any) -> None:
        self.runs += 1
        if _Controller.failures:
            _Controller.failures -= 1
            raise kopf.TemporaryError("Redis away", delay=1)

    async def close(self) -> None:
        self.closed = True


async def _daemon(memo: kopf.Memo, uid: str) -> None:
    setter = aioenums.FlagSetter()
    body = {"metadata": {"name": "train", "namespace": "ns", "uid": uid}}
    await handlers.run_job(  # type: ignore[call-arg]
        body=body,
        name="train",
        namespace="ns",
        stopped=aioenums.FlagWaiter(setter),
        logger=logging.getLogger("test"),
        memo=memo,
    )


@pytest.fixture
def memo(monkeypatch: pytest.MonkeyPatch) -> kopf.Memo:
    """An operator's memo whose daemons make `_Controller`s."""
    monkeypatch.setattr(handlers, "JobController", _Controller)
    monkeypatch.setattr(_Controller, "made", [])
    memo = kopf.Memo()
    handlers.shared_of(memo).api = object()  # type: ignore[assignment]
    return memo


async def test_a_job_applied_again_under_its_name_gets_a_controller_of_its_own(memo: kopf.Memo) -> None:
    shared = handlers.shared_of(memo)
    # A daemon that kopf restarts after an error keeps its controller (its caches, its Redis client).
    _Controller.failures = 1
    with pytest.raises(kopf.TemporaryError):
        await _daemon(memo, "uid-1")
    first = shared.controllers[("ns", "train")]
    assert not first.closed
    # The job succeeds: `run` returns, kopf will not run the daemon again, and the controller is closed.
    await _daemon(memo, "uid-1")
    assert len(_Controller.made) == 1 and first.runs == 2 and first.closed
    assert ("ns", "train") not in shared.controllers

    # Deleted and applied again: the same name, another uid, another controller.
    await _daemon(memo, "uid-2")
    assert [c.uid for c in _Controller.made] == ["uid-1", "uid-2"]


async def test_a_job_deleted_while_its_daemon_backs_off_has_its_controller_closed(memo: kopf.Memo) -> None:
    """The daemon failed (kopf waits out its backoff before the next) and the job is deleted meanwhile:
    kopf starts no daemon for it again, so the delete handler closes the controller, which nothing else
    would; one a daemon still runs, or of another job of the name, is left to its daemon."""
    shared = handlers.shared_of(memo)
    _Controller.failures = 1
    with pytest.raises(kopf.TemporaryError):
        await _daemon(memo, "uid-1")
    idle = shared.controllers[("ns", "train")]
    await handlers.idle_controller(shared.controllers, ("ns", "train"), "uid-other")
    assert not idle.closed  # another job of the name
    idle.running = True
    await handlers.idle_controller(shared.controllers, ("ns", "train"), "uid-1")
    assert not idle.closed  # its daemon closes it as it stops
    idle.running = False
    await handlers.idle_controller(shared.controllers, ("ns", "train"), "uid-1")
    assert idle.closed and ("ns", "train") not in shared.controllers


async def test_a_stale_controller_of_a_job_of_the_same_name_is_closed(memo: kopf.Memo) -> None:
    shared = handlers.shared_of(memo)
    stale = _Controller(None, None, "ns", "train", "uid-old")
    shared.controllers[("ns", "train")] = stale  # type: ignore[assignment]
    await _daemon(memo, "uid-new")
    assert stale.closed and stale.runs == 0
    assert [c.uid for c in _Controller.made] == ["uid-old", "uid-new"]


@pytest.mark.parametrize(
    "name", ["short", "a-job-with-a-name-far-longer-than-a-label-value-may-be-" + "x" * 40]
)
def test_a_job_finds_its_store_pod_whatever_the_length_of_its_name(name: str) -> None:
    pod = {
        "metadata": {"labels": {**_manifests.job_labels(name), _manifests.LABEL_ROLE: _manifests.ROLE_STORE}}
    }
    assert len(_manifests.job_label(name)) <= 63
    assert is_store_pod(pod, name)
    assert not is_store_pod(pod, name + "-other")


def test_a_deleted_jobs_metric_series_go_with_it() -> None:
    """A long-lived operator that ran many jobs kept exporting each one's last throughput and step time."""
    from prometheus_client import REGISTRY

    from resilientjob.operator import metrics

    metrics.SAMPLES_PER_SECOND.labels("gone-job").set(120.0)
    metrics.RECONFIGURATIONS.labels("gone-job", "dynamic").inc()
    metrics.REDIS_REPAIRS.labels("gone-job", "plan").inc()
    metrics.workers_not_ready("gone-job", "PodNotStarting")
    metrics.SAMPLES_PER_SECOND.labels("kept-job").set(80.0)

    def series(job: str) -> list[str]:
        return [
            sample.name
            for family in REGISTRY.collect()
            for sample in family.samples
            if sample.labels.get(metrics.JOB_LABEL) == job
        ]

    assert len(series("gone-job")) >= 3
    metrics.forget_job("gone-job")
    metrics.forget_job("gone-job")  # kopf may run the deletion handler again: nothing left is no error
    assert series("gone-job") == []
    assert series("kept-job") == ["rjob_samples_per_second"]
    metrics.forget_job("kept-job")


def test_workers_not_ready_is_one_series_for_the_current_reason_and_none_once_they_run() -> None:
    from prometheus_client import REGISTRY

    from resilientjob.operator import metrics

    def reasons(job: str) -> dict[str, float]:
        return {
            sample.labels["reason"]: sample.value
            for family in REGISTRY.collect()
            for sample in family.samples
            if sample.name == "rjob_workers_not_ready" and sample.labels.get(metrics.JOB_LABEL) == job
        }

    metrics.workers_not_ready("waits", "PodsRefused")
    metrics.workers_not_ready("waits", "PodsRefused")  # every pass says it again: nothing changes
    assert reasons("waits") == {"PodsRefused": 1.0}
    metrics.workers_not_ready("waits", "PodNotStarting")  # the cause moved on: the old series goes
    assert reasons("waits") == {"PodNotStarting": 1.0}
    metrics.workers_not_ready("waits", None)
    assert reasons("waits") == {}
    metrics.workers_not_ready("waits", "PodUnschedulable")
    metrics.forget_job("waits")
    assert reasons("waits") == {}
    metrics.workers_not_ready("waits", "PodUnschedulable")  # a job of the same name, applied again
    assert reasons("waits") == {"PodUnschedulable": 1.0}
    metrics.forget_job("waits")


def test_an_earlier_jobs_pod_is_forced_out_only_once_its_grace_is_spent() -> None:
    at = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    terminating = {"metadata": {"name": "late-node-1", "deletionTimestamp": "2027-01-15T08:00:00Z"}}
    assert not _lifecycle.stuck(terminating, at + 59, 60.0)  # its kubelet may still confirm it
    assert _lifecycle.stuck(terminating, at + 60, 60.0)  # counted from the end of its grace period
    assert not _lifecycle.stuck({"metadata": {"name": "late-node-2"}}, at + 600, 60.0)  # not being deleted


def test_an_earlier_jobs_orphans_are_deleted_by_name_or_when_many_by_the_jobs_label() -> None:
    few = [f"pod/llama-node-{n}" for n in range(3)] + ["configmap/llama-plan"]
    assert _lifecycle.delete_command("team-a", "llama", few) == f"kubectl delete -n team-a {' '.join(few)}"
    many = [f"pod/llama-node-{n}" for n in range(64)]
    command = _lifecycle.delete_command("team-a", "llama", many)
    # An Event's message is cut at 1024 characters: the command must survive whole.
    assert (
        command == f"kubectl delete -n team-a pods,configmaps,services -l {_manifests.job_selector('llama')}"
    )
    assert len(command) < 200
