"""The telemetry half of a reconcile pass: measured throughput, and the fail-slow inputs (reports, iteration
times, profiles, validation results) through the job's `FailSlowTracker`, with the Events and status they
call for. The pass sees the job only through `PassContext` and hands back a `PassOutcome` (the status fields
it measured, whether they must be written now, and a mitigation the tracker asked for) that the controller
applies: it publishes the mitigation as a generation (or defers it while another decision runs) and stores
the episode's state in the same commit.

Validation (Falcon 4.3): when a communication report waits for one, the pass sets a `ValidationRequest` for
the current generation with the suspects, and reads the `ValidationResult` stream for its id. The tracker's
state is stored in Redis whenever it changed (except between a decision and its commit), so a restarted
operator continues the episode (`restore_failslow`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resilientjob.planner.profile import ModelProfile
from resilientjob.protocol.messages import PlanAnnouncement

from . import _failslow, api, metrics
from ._failslow_types import Candidate
from ._redis_state import JobRedis, Published
from ._straggler import planned_shares

log = logging.getLogger("resilientjob.operator")

_EVENTS = {
    _failslow.FindingKind.SLOW: ("Warning", api.Reason.NODE_SLOW),
    _failslow.FindingKind.RECOVERED: ("Normal", api.Reason.NODE_RECOVERED),
    _failslow.FindingKind.DISMISSED: ("Normal", api.Reason.SLOW_REPORT_DISMISSED),
    _failslow.FindingKind.SLOW_LINK: ("Warning", api.Reason.SLOW_LINK_FOUND),
    _failslow.FindingKind.SLOW_DEVICE: ("Warning", api.Reason.SLOW_DEVICE_FOUND),
}


DISMISSED_EVENT_INTERVAL_S = 60.0
"""At most one `SlowReportDismissed` Event per job in this many seconds; every dismissal is logged. Agents on
a noisy host report a change every few seconds, each judged and dismissed by the operator: as Events they
would bury the few that matter (a 30-minute healthy run of the demo dismissed about a thousand)."""


@dataclass(slots=True)
class EventThrottle:
    """Lets one Event through per `interval_s`; the next says how many were held back meanwhile."""

    interval_s: float = DISMISSED_EVENT_INTERVAL_S
    last: float = -math.inf
    held: int = 0

    def admit(self, message: str, now: float) -> str | None:
        """The message to post now, or None to hold it back."""
        if now - self.last < self.interval_s:
            self.held += 1
            return None
        if self.held:
            message += f" ({self.held} more since the last such Event: see the operator's log)"
        self.last, self.held = now, 0
        return message


@dataclass(frozen=True, slots=True)
class PassContext:
    """What a telemetry pass needs of its job (the controller builds it for every pass)."""

    namespace: str
    name: str
    redis: JobRedis
    tracker: _failslow.FailSlowTracker
    profile: ModelProfile
    validation_timeout_s: float
    working: Callable[[int], bool]
    """Whether a node's pod runs its worker (`WorkerPods.working`): the status's count of live workers."""
    event: Callable[[str, api.Reason, str], None]
    """A Kubernetes Event on the job (kind, reason, message), posted as the pass goes."""


@dataclass(frozen=True, slots=True)
class PassOutcome:
    """What the controller applies after a pass."""

    status: dict[str, Any]
    """Status fields measured by the pass."""
    force_status: bool
    """A fail-slow episode opened or closed: news, to be patched now rather than after the status interval."""
    mitigation: _failslow.Mitigation | None
    """A mitigation to publish (or, while another decision runs, to hand back as `deferred`)."""


SWITCHES_KEPT = 8
"""Generations whose measured switch the pass keeps (a recovery's workers report within a few steps)."""


@dataclass(slots=True)
class TelemetryPass:
    """Per-job telemetry state kept between passes."""

    rates: dict[int, tuple[int, float, int]] = field(default_factory=dict)
    """node -> (generation, seconds, samples) of its latest step."""
    progress: tuple[int, int, float | None] | None = None
    """(generation, committed steps, loss) of the newest step reported: a checkpoint restart goes back in
    steps but forward in generations, so generation first (the synthetic loop reports no loss)."""
    deferred: _failslow.Mitigation | None = None
    """A mitigation that came while another decision ran; published by the first pass after it."""
    holding: bool = False
    """A mitigation is decided but not committed: the episode's state is stored with its commit (in one
    transaction), not before, so that a kill in between neither loses nor repeats the decision."""
    dismissals: EventThrottle = field(default_factory=EventThrottle)
    """Dismissed reports' Events (`DISMISSED_EVENT_INTERVAL_S`)."""
    validations: EventThrottle = field(default_factory=EventThrottle)
    """`ValidationRequested` Events, as many on a noisy host: each pass is in the operator's log, and its
    finding (a slow link or device, or the report dismissed) has an Event of its own."""
    switches: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    """Generation -> (slowest rendezvous s, slowest copy s, bytes received) the workers reported so far
    (`_decide.measured_switches` puts them into the status's recoveries); the newest few kept."""

    async def resume(self, redis: JobRedis) -> None:
        """Where training is, for an operator that has read no record yet: a restarted one reads only the
        records that come after its start, and until the next came it took a job at its last step for one
        still training (its workers' silence as failures, replacements and joins asked for)."""
        if self.progress is None and (record := await redis.latest_iteration()) is not None:
            self.progress = (record.generation, record.step, record.loss)

    async def run(self, ctl: PassContext, current: Published) -> PassOutcome:
        """Read the new telemetry; the outcome holds the status it measured and a mitigation to start."""
        redis, tracker = ctl.redis, ctl.tracker
        published = current.message
        watched = current.watched
        if tracker.gate.generation != published.generation:
            tracker.gate.new_generation(published.generation, planned_shares(published.plan, ctl.profile))
            tracker.idle = current.idle
        mitigation, self.deferred = self.deferred, None
        slow_before = set(tracker.slow)
        # Reports first: a recovery closes the episode before more iterations are charged to it. Those that
        # came before the steps to judge them by are judged now, on the last pass's steps.
        mitigation = tracker.recheck() or mitigation
        for report in await redis.new_reports():
            if report.node in watched and report.generation <= published.generation:
                mitigation = tracker.report(report) or mitigation
        for record in await redis.new_iterations():
            # A parked node's probe steps count on from its own last step under the current generation:
            # they are no training progress (taken for it, they ended a job early and re-armed `_aborts`).
            newer = self.progress is None or (record.generation, record.step) > self.progress[:2]
            if record.node in current.plan_nodes and newer:
                self.progress = (record.generation, record.step, record.loss)
            if record.generation == published.generation:
                self.rates[record.node] = (record.generation, record.seconds, record.samples)
            # Generation 0's rendezvous is the job's start (image pulls, model loading): no recovery.
            if record.generation > 0 and record.rendezvous_s is not None and record.copy_s is not None:
                self._switched(
                    record.generation, record.rendezvous_s, record.copy_s, record.copied_bytes or 0
                )
            if record.node in current.plan_nodes and record.node not in current.idle:
                # Parked and drained nodes' probe steps are other work: not in the levels.
                tracker.observe(record)
            if record.generation == published.generation:
                tracker.probe_step(record, in_plan=record.node in current.plan_nodes)
            if record.node in watched and mitigation is None:
                mitigation = tracker.iteration(record)
        for profile in await redis.new_profiles():
            if profile.node in watched and profile.generation == published.generation:
                tracker.profile(profile)
        mitigation = await self._validation(ctl, published) or mitigation
        mitigation = tracker.parked_recheck(current.plan_nodes) or mitigation
        tracker.tick()
        for finding in tracker.drain_findings():
            self._report_finding(ctl, finding)
        if mitigation is not None:
            self.holding = True
        if tracker.changed and not self.holding:
            await redis.save_failslow(tracker.state())
            tracker.changed = False
        status = self._status(ctl, current)
        return PassOutcome(status, force_status=set(tracker.slow) != slow_before, mitigation=mitigation)

    def _switched(self, generation: int, rendezvous_s: float, copy_s: float, copied: int) -> None:
        """One worker's switch to `generation` (its first step's record): per worker in the histogram, the
        slowest worker's for the generation's recovery."""
        metrics.RECOVERY_SECONDS.labels("resume").observe(rendezvous_s)
        metrics.RECOVERY_SECONDS.labels("transfer").observe(copy_s)
        before = self.switches.get(generation, (0.0, 0.0, 0))
        self.switches[generation] = (max(before[0], rendezvous_s), max(before[1], copy_s), before[2] + copied)
        for old in sorted(self.switches)[:-SWITCHES_KEPT]:
            del self.switches[old]

    async def _validation(self, ctl: PassContext, published: PlanAnnouncement) -> _failslow.Mitigation | None:
        """Results in (a drained node's revalidation may return the restore), the pass the tracker wants
        out."""
        redis, tracker = ctl.redis, ctl.tracker
        restore = None
        for result in await redis.new_validation_results():
            restore = tracker.validated(result) or restore
        if tracker.validation_timeout():
            timeout = ctl.validation_timeout_s
            log.warning(
                "job %s/%s: no validation result within %.0fs; the episode goes on without it",
                ctl.namespace,
                ctl.name,
                timeout,
            )
            ctl.event(
                "Normal",
                api.Reason.VALIDATION_TIMED_OUT,
                f"no validation result within {timeout:.0f}s; the slow report stands unvalidated",
            )
        suspects = tracker.validation_wanted()
        drained = None if suspects is not None else tracker.revalidation_wanted()
        if suspects is not None:
            reporters = ", ".join(_reporter(candidate) for candidate in tracker.asking())
            reason = f"communication slowdown reported by {reporters}; suspects {suspects}"
        elif drained is not None:
            suspects = drained
            reason = f"drained nodes {drained} sent no recovery report; their devices timed again"
        else:
            return restore
        request = await redis.request_validation(published.generation, suspects, reason)
        tracker.validation_sent(request.id, revalidating=drained or ())
        message = f"validation {request.id} at generation {published.generation}: {reason}"
        log.info("job %s/%s: %s", ctl.namespace, ctl.name, message)
        admitted = self.validations.admit(message, time.monotonic())
        if admitted is not None:
            ctl.event("Normal", api.Reason.VALIDATION_REQUESTED, admitted)
        return restore

    def _report_finding(self, ctl: PassContext, finding: _failslow.Finding) -> None:
        kind, reason = _EVENTS[finding.kind]
        if finding.kind is _failslow.FindingKind.SLOW:
            metrics.FAIL_SLOW_EVENTS.labels(ctl.name).inc()
        log.info("job %s/%s: %s: %s", ctl.namespace, ctl.name, reason, finding.message)
        message: str | None = finding.message
        if finding.kind is _failslow.FindingKind.DISMISSED:
            message = self.dismissals.admit(finding.message, time.monotonic())
        if message is not None:
            ctl.event(kind, reason, message)

    def _status(self, ctl: PassContext, current: Published) -> dict[str, Any]:
        tracker = ctl.tracker
        plan_nodes = current.plan_nodes
        generation = current.message.generation
        rates = {n: r for n, r in self.rates.items() if r[0] == generation and n in plan_nodes}
        throughput = sum(samples / seconds for _, seconds, samples in rates.values())
        step = max((seconds for _, seconds, _ in rates.values()), default=0.0)
        alive = sum(1 for node in plan_nodes if ctl.working(node))
        total = len(plan_nodes)
        metrics.ACTIVE_WORKERS.labels(ctl.name).set(alive)
        metrics.SAMPLES_PER_SECOND.labels(ctl.name).set(throughput)
        metrics.STEP_TIME.labels(ctl.name).set(step)
        if self.progress is not None:
            metrics.TRAINING_STEP.labels(ctl.name).set(self.progress[1])
            if self.progress[2] is not None:
                metrics.TRAINING_LOSS.labels(ctl.name).set(self.progress[2])
        return {
            "throughput": round(throughput, 2),
            "workers_alive": alive,
            "workers_total": total,
            "workers": f"{alive}/{total}",
            "slow_nodes": sorted(set(tracker.slow) & current.watched),
            "slow_links": [f"{a}->{b}" for a, b in sorted(tracker.links)],
            **(_progress_status(*self.progress) if self.progress is not None else {}),
        }


def _reporter(candidate: Candidate) -> str:
    """Who reported a communication slowdown that waits for a pass, and what, for the pass's reason."""
    report = candidate.report
    who = "the job-level trigger" if candidate.job_level else "its agent"
    return f"node {report.node} ({who}: {report.slowdown:.2f}x since step {report.onset_step})"


def _progress_status(generation: int, step: int, loss: float | None) -> dict[str, int | float | None]:
    # Rounded so that noise below the column's precision does not make a status patch of its own.
    return {"step": step, "loss": None if loss is None else round(loss, 6)}


async def restore_failslow(ctl: PassContext) -> bool:
    """Continue a stored fail-slow episode in a (re)started operator; False when there is none."""
    redis, tracker = ctl.redis, ctl.tracker
    state = await redis.load_failslow()
    if state is None:
        return False
    try:
        tracker.restore(state)
    except (KeyError, ValueError, TypeError) as exc:
        log.warning(
            "job %s/%s: stored fail-slow state unusable (%r); starting over", ctl.namespace, ctl.name, exc
        )
        return False
    log.info(
        "job %s/%s: fail-slow episode restored: slow %s, loss %.1fs, applied %s",
        ctl.namespace,
        ctl.name,
        sorted(tracker.slow),
        tracker.controller.loss_s,
        [str(s) for s in tracker.controller.applied],
    )
    return True
