"""Capacity comes back: the operator keeps `spec.nodes` worker pods asked for.

A failed worker's pod is fenced (deleted) and the planner plans around it; this module then asks for a new
pod in its place, under a new node id (ids are never reused, so no stale state, Redis key or rendezvous rank
of a fenced node can be mistaken for the new one). The new pod is Pending until the scheduler finds room;
once it runs it joins through the planner like any returning node (`_decide.detect_joins`, the scale-up
choice by Odyssey's eq. 8, layers copied peer-to-peer by the workers).

A pod that keeps failing is not re-created in a tight loop: each replacement carries the count of quick
failures in a row of the pods it replaces (its `strikes`, an annotation of the pod), and the replacement
after a quick failure waits `Backoff.delay_s(strikes)`, doubling up to a bound, as the kubelet's
CrashLoopBackOff does for a container. A pod that ran `stable_s` before failing starts the count over.

The record is the job's status (`status.capacity`): the next node id and the replacements waiting out their
backoff. It is written before any pod is created, so an operator restarted at any point neither reuses an
id nor forgets a backoff (at worst it skips an id). The decision itself (`replacements`, `after_failure`) is
pure; `CapacityKeeper` observes and applies it for one job's controller.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from resilientjob.protocol.messages import PlanAnnouncement

from . import api
from ._decide import PodView
from ._job_view import JobView
from .kube import PodsRefused, core_path


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long a replacement waits after quick failures of the pods before it."""

    base_s: float = 10.0
    """Wait after the second quick failure in a row (the first one is replaced at once)."""

    max_s: float = 300.0
    """Upper bound of the wait, however many failures came before."""

    stable_s: float = 60.0
    """A pod that ran this long before failing was no crash loop: its replacement starts the count over."""

    def __post_init__(self) -> None:
        if not (0 <= self.base_s <= self.max_s) or self.stable_s < 0:
            raise ValueError("backoff: need 0 <= base_s <= max_s and stable_s >= 0")

    def delay_s(self, strikes: int) -> float:
        """Seconds before the replacement of a pod that was the `strikes`-th quick failure in a row."""
        if strikes <= 1:
            return 0.0
        return min(self.max_s, self.base_s * 2.0 ** min(strikes - 2, 64))

    def strikes(self, previous: int, lived_s: float | None) -> int:
        """Strikes of a failed pod that carried `previous` and lived `lived_s` (None: unknown, such as a pod
        deleted by hand: not counted as a crash)."""
        if lived_s is None or lived_s >= self.stable_s:
            return 0
        return previous + 1


def rfc3339(at: float) -> str:
    """Unix time as RFC 3339 in whole seconds, rounded up (a wait never ends early)."""
    moment = datetime.datetime.fromtimestamp(math.ceil(at), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def unix_time(text: str) -> float | None:
    """The Unix time of an RFC 3339 timestamp; None for an empty or unreadable one."""
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def after_failure(
    capacity: api.CapacityStatus, pod: PodView | None, now: float, backoff: Backoff
) -> api.CapacityStatus:
    """The record once the pod of a failed worker is gone: its replacement waits by the pod's strikes."""
    created = unix_time(pod.created) if pod is not None else None
    lived = None if created is None else max(0.0, now - created)
    strikes = backoff.strikes(pod.strikes if pod is not None else 0, lived)
    delay = backoff.delay_s(strikes)
    # No wait: no time either (whole seconds rounded up would hold it back up to a second).
    waiting = api.WaitingReplacement(strikes=strikes, not_before=rfc3339(now + delay) if delay else "")
    return capacity.model_copy(update={"waiting": [*capacity.waiting, waiting]})


@dataclass(frozen=True, slots=True)
class Replacements:
    """What to ask for now."""

    create: tuple[tuple[int, int], ...]
    """(new node id, strikes) of each pod to create."""

    capacity: api.CapacityStatus
    """The record to write before creating them."""

    held: tuple[api.WaitingReplacement, ...]
    """Replacements still waiting out their backoff."""


def replacements(
    capacity: api.CapacityStatus, *, target: int, live: int, known: Iterable[int], now: float
) -> Replacements:
    """Pods to create so that `target` worker pods are asked for when `live` are (Pending or running).

    The missing pods are the waiting replacements first, the longest-waiting ones first (more waiting than
    missing: a pod came back by other means and the surplus is dropped), then fresh ones for any shortfall
    the record does not explain (pods deleted while no operator ran): those have no strikes. Each gets the
    next id above every id the job has known (`known`: pods, plan nodes, failed nodes) and the record's
    `next_node_id`, and never below `target`, the initial ids 0..target-1."""
    missing = max(0, target - live)
    waiting = sorted(capacity.waiting, key=lambda w: unix_time(w.not_before) or 0.0)[:missing]
    due = [w for w in waiting if (unix_time(w.not_before) or 0.0) <= now]
    held = tuple(w for w in waiting if (unix_time(w.not_before) or 0.0) > now)
    strikes = [w.strikes for w in due] + [0] * (missing - len(waiting))
    first = max(capacity.next_node_id, target, max(known, default=-1) + 1)
    create = tuple((first + index, count) for index, count in enumerate(strikes))
    record = capacity.model_copy(
        update={
            "next_node_id": first + len(create) if create else max(capacity.next_node_id, first),
            "replaced": capacity.replaced + len(create),
            "waiting": list(held),
        }
    )
    return Replacements(create=create, capacity=record, held=held)


@dataclass(slots=True)
class CapacityKeeper:
    """Observes one job's worker pods each pass and asks for replacements (`replacements`)."""

    backoff: Backoff = field(default_factory=Backoff)
    _handled: set[str] = field(default_factory=set)
    """Uids of failed pods already counted (deleting them takes an event round-trip to show)."""
    _announced: set[str] = field(default_factory=set)
    """`not_before` times of waits already told in an Event."""

    def fenced(self, ctl: JobView, node: int, now: float | None = None) -> None:
        """A failed worker of the plan was fenced: its replacement waits by its strikes (a job that replaces
        nobody, `replaceFailedNodes: false`, records no wait: nothing would ever take it off)."""
        if not ctl.require_spec().replace_failed_nodes:
            return
        pod = ctl.pods.get(node)
        if pod is not None:
            if pod.uid in self._handled:
                return
            self._handled.add(pod.uid)
        now = time.time() if now is None else now
        capacity = after_failure(ctl.status.capacity, pod, now, self.backoff)
        ctl.status = ctl.status.model_copy(update={"capacity": capacity})

    async def keep_up(self, ctl: JobView, current: PlanAnnouncement, fenced: Collection[int]) -> None:
        """Delete failed pods no plan uses (replacements that crashed before joining), then ask for the
        pods missing from `spec.nodes`: the record first, then the pods."""
        spec = ctl.require_spec()
        now = time.time()
        in_plan = set(current.plan.nodes) | set(current.parked)
        self._handled &= {pod.uid for pod in ctl.pods.values()}  # the rest are gone for good
        for node, pod in list(ctl.pods.items()):
            if pod.failed is None or pod.completed or node in in_plan or pod.uid in self._handled:
                continue
            # Never in the plan (or idle): no generation to replan, only the pod to clear and count.
            await ctl.kube.delete(core_path(ctl.namespace, "pods", pod.name), grace_period_s=0)
            self.fenced(ctl, node, now)
        live = sum(1 for node, pod in ctl.pods.items() if pod.failed is None and node not in fenced)
        known = [*ctl.pods, *current.plan.nodes, *current.plan.failed_nodes, *current.parked, *fenced]
        decided = replacements(ctl.status.capacity, target=spec.nodes, live=live, known=known, now=now)
        if decided.capacity != ctl.status.capacity:
            ctl.status = ctl.status.model_copy(update={"capacity": decided.capacity})
            await ctl.write_status(force=True)  # durable before any pod exists under the new ids
        if decided.create:
            strikes = dict(decided.create)
            generation, layout = current.generation, current.layout
            if ctl.status.plan_generation > generation:  # applied meanwhile by a background decision
                generation, layout = ctl.status.plan_generation, ctl.status.layout
            made = list(decided.create)
            try:
                await ctl.create_pods(strikes, generation, layout, strikes=strikes)
            except PodsRefused as refused:
                # Training goes on without them; each refused one waits to be asked for again (under a new
                # id, with its strikes), as after a backoff. The pods of the batch the server took were read
                # back (`WorkerPods.create`): they count as replaced, and are told below.
                made = [(node, count) for node, count in decided.create if node in ctl.pods]
                retry_at = rfc3339(now + (refused.delay or 0.0))
                self._announced.add(retry_at)  # a refusal (its Event told), not a crash loop's backoff
                again = [
                    api.WaitingReplacement(strikes=count, not_before=retry_at)
                    for node, count in decided.create
                    if node not in ctl.pods
                ]
                capacity = ctl.status.capacity
                update = {"waiting": [*capacity.waiting, *again], "replaced": capacity.replaced - len(again)}
                ctl.status = ctl.status.model_copy(update={"capacity": capacity.model_copy(update=update)})
                await ctl.write_status(force=True)
            for node, count in made:
                after = f" after {count} quick failure(s) in a row" if count else ""
                ctl.event(
                    "Normal",
                    api.Reason.NODE_REPLACED,
                    f"asked for node {node} to keep {spec.nodes} workers{after}; it joins once it runs",
                )
        for waiting in decided.held:
            if waiting.not_before not in self._announced:
                self._announced.add(waiting.not_before)
                ctl.event(
                    "Warning",
                    api.Reason.REPLACEMENT_BACKOFF,
                    f"a worker failed {waiting.strikes} times in a row soon after starting; its "
                    f"replacement waits until {waiting.not_before} (backoff "
                    f"{self.backoff.delay_s(waiting.strikes):.0f}s, at most {self.backoff.max_s:.0f}s)",
                )
