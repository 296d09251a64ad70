"""The operator's Prometheus metrics (served by `rjob operator --metrics-port`).

A job's series carry its name in the label `rjob`, not `job`: Prometheus sets `job` on every target (the
scrape job), so an exported `job` label would be renamed `exported_job` or, with honorLabels, would replace
the scrape job's name. The worker agents' series get the same `rjob` label from the chart's PodMonitor."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

from resilientjob.protocol.messages import export_drop_counts

JOB_LABEL = "rjob"
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 120)

PLAN_GENERATION = Gauge("rjob_plan_generation", "Published plan generation.", [JOB_LABEL])
ACTIVE_WORKERS = Gauge("rjob_active_workers", "Workers alive in the current plan.", [JOB_LABEL])
STEP_TIME = Gauge("rjob_step_time_seconds", "Measured step time (slowest reporting worker).", [JOB_LABEL])
SAMPLES_PER_SECOND = Gauge("rjob_samples_per_second", "Measured training throughput.", [JOB_LABEL])
TRAINING_STEP = Gauge("rjob_training_step", "Committed global steps (status.step).", [JOB_LABEL])
TRAINING_LOSS = Gauge("rjob_training_loss", "Loss of the last committed step (status.loss).", [JOB_LABEL])
RECONFIGURATIONS = Counter(
    "rjob_reconfigurations_total", "Generations published after the first, by policy.", [JOB_LABEL, "policy"]
)
RECOVERY_SECONDS = Histogram(
    "rjob_recovery_seconds",
    "Recovery time by phase: detect and plan (the operator's, per recovery), transfer (layer copies) and "
    "resume (rendezvous into the new generation), per worker as each reports its switch.",
    ["phase"],
    buckets=_LATENCY_BUCKETS,
)
DETECTION_SECONDS = Histogram(
    "rjob_detection_latency_seconds",
    "Last sign of life (the failing pod event, the last heartbeat written) to the decision, by path.",
    ["path"],
    buckets=_LATENCY_BUCKETS,
)
FAIL_SLOW_EVENTS = Counter(
    "rjob_fail_slow_events_total", "Fail-slow change points reported by workers.", [JOB_LABEL]
)
INVALID_JOBS = Counter("rjob_invalid_jobs_total", "ResilientJobs rejected for an invalid spec.")
REDIS_RESTORES = Counter(
    "rjob_redis_restores_total",
    "Plan keys restored from the durable record after Redis lost them (a restart that came back empty).",
    [JOB_LABEL],
)
REDIS_REPAIRS = Counter(
    "rjob_redis_repairs_total",
    "Undecodable values found in Redis and repaired or dropped, by kind (plan, heartbeat, telemetry).",
    [JOB_LABEL, "kind"],
)
REDIS_OUTAGES = Counter("rjob_redis_outages_total", "Redis outages seen by a job's loop.", [JOB_LABEL])
WORKERS_NOT_READY = Gauge(
    "rjob_workers_not_ready",
    "1 while the job's worker pods do not all run (its WorkersReady condition is False), labelled with why: "
    "PodNotStarting, PodUnschedulable, PodsRefused, PodsStarting, NodeFailed. No series while they do, nor "
    "for a job that ended.",
    [JOB_LABEL, "reason"],
)

_PER_JOB: dict[Counter | Gauge, tuple[str, ...]] = {
    PLAN_GENERATION: (),
    ACTIVE_WORKERS: (),
    STEP_TIME: (),
    SAMPLES_PER_SECOND: (),
    TRAINING_STEP: (),
    TRAINING_LOSS: (),
    RECONFIGURATIONS: ("policy",),
    FAIL_SLOW_EVENTS: (),
    REDIS_RESTORES: (),
    REDIS_REPAIRS: ("kind",),
    REDIS_OUTAGES: (),
    WORKERS_NOT_READY: ("reason",),
}
"""The series that name a job, with their other labels: a deleted job's go with it (`forget_job`)."""


def forget_job(job: str) -> None:
    """Drop every series of the deleted job `job`: a long-lived operator that ran thousands of jobs kept
    exporting each one's last step time and throughput, as if it still ran."""
    for metric, others in _PER_JOB.items():
        found = {
            tuple(sample.labels[name] for name in others)
            for family in metric.collect()
            for sample in family.samples
            if sample.labels.get(JOB_LABEL) == job
        }
        for rest in found:
            with contextlib.suppress(KeyError):
                metric.remove(job, *rest)
    _NOT_READY.pop(job, None)


_NOT_READY: dict[str, str] = {}
"""The reason each job's `rjob_workers_not_ready` series carries now."""


def workers_not_ready(job: str, reason: str | None) -> None:
    """The job's one `rjob_workers_not_ready` series, for `reason`; none when `reason` is None (every worker
    runs, or the job ended). A pass that finds the same reason changes nothing."""
    before = _NOT_READY.get(job)
    if before == reason:
        return
    if before is not None:
        with contextlib.suppress(KeyError):
            WORKERS_NOT_READY.remove(job, before)
        del _NOT_READY[job]
    if reason is not None:
        WORKERS_NOT_READY.labels(job, reason).set(1)
        _NOT_READY[job] = reason


export_drop_counts()
