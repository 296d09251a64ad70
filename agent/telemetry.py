"""The agent's telemetry: heartbeats (a key with a TTL, renewed every 0.5 s), iteration times into a capped
Redis stream, per-worker change-point detection (the planner's BOCD + verification,
`planner.failslow.ChangeDetector`) with slow and recovery reports to the operator, and the plan it must run
(current generation by key, new generations by pub/sub). Everything read back is validated and bad input is
dropped and counted; nothing here raises on hostile data.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import AsyncIterator, Hashable
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import RedisError

from resilientjob.planner.failslow import ChangeDetector, ChangeEvent, ChangeKind, DetectorConfig

from ._redis import HEARTBEAT_TTL_S, STREAM_MAXLEN, JobKeys
from .telemetry_messages import (
    MAX_PLAN_BYTES,
    Heartbeat,
    IterationRecord,
    PlanAnnouncement,
    ProfileRecord,
    SlowKind,
    SlowReport,
    decode,
    encode,
)

HEARTBEAT_INTERVAL_S = 0.5

WARMUP_STEPS = 5
"""Steps not fed to the detectors after (re)starting detection: the first steps of a worker or of a new
role carry start-up costs (allocations, first collectives of new groups) that are no fail-slow."""

AGENT_DETECTOR = DetectorConfig(min_change=0.25)
"""Detector settings of a live worker. The level check is 25%, not Falcon's 10%: on a loaded 2-core machine
every worker's compute moved 13-34% at once for tens of steps (scheduling delays stretching short sleeps
while other jobs ran), which a 10% check reports as fail-slows; 1.5x slowdowns are still confirmed within
a few steps (docs/benchmarks/failslow-e2e.md)."""

STEP_SECONDS = Histogram(
    "rjob_agent_step_seconds",
    "Wall time of one training step on this worker.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
SAMPLES_PER_SECOND = Gauge("rjob_agent_samples_per_second", "Samples/s processed by this worker.")
GENERATION = Gauge("rjob_agent_plan_generation", "Plan generation this worker runs.")
COMMITTED_STEP = Gauge("rjob_agent_step", "Committed global steps of the job, as this worker last saw them.")
LOSS = Gauge("rjob_agent_loss", "The job's training loss at the last committed step.")
HEARTBEATS = Counter("rjob_agent_heartbeats_total", "Heartbeats written.")
HEARTBEAT_ERRORS = Counter("rjob_agent_heartbeat_errors_total", "Heartbeats that failed to reach Redis.")
SLOW_REPORTS = Counter("rjob_agent_slow_reports_total", "Fail-slow change points reported.", ["kind"])


def queue_beat(pipe: Any, keys: JobKeys, node: int, message: bytes, ttl_s: float = HEARTBEAT_TTL_S) -> None:
    """Queue one heartbeat on a pipeline (async or sync): the key with its TTL and the node's bit in the
    job's `beaten` bitmap. One round trip per beat, or per batch of agents when one process drives many."""
    pipe.set(keys.heartbeat(node), message, px=int(ttl_s * 1000))
    pipe.setbit(keys.beaten, node, 1)


class Telemetry:
    """One worker's link to the operator through Redis."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: JobKeys,
        node: int,
        pod: str,
        *,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
        detector: DetectorConfig | None = None,
        warmup: int = WARMUP_STEPS,
    ) -> None:
        if not 0 < heartbeat_interval_s < heartbeat_ttl_s:
            raise ValueError("heartbeat_interval_s must be > 0 and below heartbeat_ttl_s")
        self.client = client
        self.keys = keys
        self.node = node
        self.pod = pod
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        if warmup < 0:
            raise ValueError(f"warmup: must be >= 0, got {warmup}")
        self.detector_config = detector or AGENT_DETECTOR
        self.warmup = warmup
        self.detector = ChangeDetector(self.detector_config)
        """On the step (wall) time."""
        self.compute_detector = ChangeDetector(self.detector_config)
        """On the compute time of each step, when the worker reports it."""
        self._computes: list[float] = []
        self._detector_start = warmup  # step of this worker fed first to the current detectors
        self._skipped = 0
        self._role: Hashable = None
        self.generation = -1
        self.step = 0

    async def beat(self, ttl_s: float | None = None) -> None:
        """One heartbeat, alive for `ttl_s` (default `heartbeat_ttl_s`)."""
        message = Heartbeat(
            node=self.node, pod=self.pod, generation=self.generation, step=self.step, sent_at=time.time()
        )
        async with self.client.pipeline(transaction=False) as pipe:
            queue_beat(pipe, self.keys, self.node, encode(message), ttl_s or self.heartbeat_ttl_s)
            await pipe.execute()
        HEARTBEATS.inc()

    async def heartbeat_forever(self, stopped: asyncio.Event) -> None:
        """Beat until `stopped`; a Redis hiccup is counted and retried at the next beat, never fatal."""
        while not stopped.is_set():
            try:
                await self.beat()
            except (RedisError, OSError):
                HEARTBEAT_ERRORS.inc()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), self.heartbeat_interval_s)

    def _restart_detection(self, step: int, key: Hashable) -> None:
        self.detector = ChangeDetector(self.detector_config)
        self.compute_detector = ChangeDetector(self.detector_config)
        self._computes = []
        self._detector_start = step + self.warmup
        self._skipped = 0
        self._role = key

    async def record_iteration(
        self,
        generation: int,
        step: int,
        seconds: float,
        samples: int,
        role: Hashable | None = None,
        *,
        compute_s: float | None = None,
        communication_s: float | None = None,
        loss: float | None = None,
    ) -> SlowReport | None:
        """Append one step to the job's iteration stream; report a change point when a detector sees one.

        With `compute_s` (the step's time outside communication, from the trace) two detectors run: one on
        compute time, reporting `kind=compute` (the node itself slowed: a peer waiting for it sees its
        communication grow, not its compute), and one on the step time, reporting `kind=communication`
        only when compute did not move at the same onset. Without it the step time alone is watched and a
        change is reported as compute (the synthetic loop).

        `role` is what this worker computes (its stages and micro-batches, or a probe step when the plan
        does not use it); detection starts over when it changes, since the normal step time changes with
        it, and ignores the first `warmup` steps after (start-up noise). Without a role every new generation
        starts over. Keeping the detectors across generations that leave this worker's work alone matters:
        a detector in its warm-up cannot see a change yet."""
        key = role if role is not None else generation
        if generation != self.generation or key != self._role:
            if key != self._role:
                self._restart_detection(step, key)
            self.generation = generation
            GENERATION.set(generation)
        self.step = step
        COMMITTED_STEP.set(step)
        if loss is not None and math.isfinite(loss):
            LOSS.set(loss)
        else:
            loss = None
        STEP_SECONDS.observe(seconds)
        SAMPLES_PER_SECOND.set(samples / seconds)
        record = IterationRecord(
            node=self.node,
            generation=generation,
            step=step,
            seconds=seconds,
            samples=samples,
            sent_at=time.time(),
            compute_s=compute_s,
            communication_s=communication_s,
            loss=loss,
        )
        await self.client.xadd(
            self.keys.iterations, {"m": encode(record)}, maxlen=STREAM_MAXLEN, approximate=True
        )
        if self._skipped < self.warmup:
            self._skipped += 1
            return None
        compute_event = None
        if compute_s is not None:
            self._computes.append(compute_s)
            compute_event = self.compute_detector.feed(compute_s)
        step_event = self.detector.feed(seconds)
        if compute_event is not None:
            return await self._report(generation, step, compute_event, SlowKind.COMPUTE)
        if step_event is None:
            return None
        if compute_s is None:
            return await self._report(generation, step, step_event, SlowKind.COMPUTE)
        if self._compute_moved(step_event.index):
            return None  # the compute detector owns this change (reported already, or soon)
        return await self._report(generation, step, step_event, SlowKind.COMMUNICATION)

    def _compute_moved(self, onset: int) -> bool:
        """Whether compute time shifted at `onset` (an index into the fed samples) as much as a change."""
        before = self._computes[max(0, onset - self.detector_config.baseline) : onset]
        after = self._computes[onset:]
        if not before or not after:
            return False
        ratio = statistics.median(after) / statistics.median(before)
        return abs(math.log(ratio)) >= math.log1p(self.detector_config.min_change)

    async def _report(self, generation: int, step: int, event: ChangeEvent, kind: SlowKind) -> SlowReport:
        report = SlowReport(
            node=self.node,
            generation=generation,
            step=step,
            onset_step=self._detector_start + event.index,
            slowdown=event.ratio,
            baseline_s=event.before_s,
            level_s=event.after_s,
            kind=kind,
            recovered=event.kind is ChangeKind.RECOVERY,
            detected_at=time.time(),
        )
        await self.client.xadd(
            self.keys.reports, {"m": encode(report)}, maxlen=STREAM_MAXLEN, approximate=True
        )
        SLOW_REPORTS.labels(report.kind).inc()
        return report

    async def record_profile(
        self,
        *,
        generation: int,
        step: int,
        iterations: int,
        iteration_s: float,
        compute_s: float,
        communication_s: float,
        groups: dict[str, float],
    ) -> ProfileRecord:
        """Send one per-group profile of the recent window (`tracing.profile`, group labels in node ids)."""
        record = ProfileRecord(
            node=self.node,
            generation=generation,
            step=step,
            iterations=iterations,
            iteration_s=iteration_s,
            compute_s=compute_s,
            communication_s=communication_s,
            groups=groups,
            sent_at=time.time(),
        )
        await self.client.xadd(
            self.keys.profiles, {"m": encode(record)}, maxlen=STREAM_MAXLEN, approximate=True
        )
        return record

    async def current_plan(self) -> PlanAnnouncement | None:
        raw = await self.client.get(self.keys.plan)
        return decode(PlanAnnouncement, raw, "agent.plan", MAX_PLAN_BYTES)

    async def plan_updates(self, stopped: asyncio.Event) -> AsyncIterator[PlanAnnouncement]:
        """New generations as the operator publishes them (pub/sub fast path), in increasing order; after a
        reconnect the current key is re-read so that no generation is skipped silently."""
        last = self.generation
        pubsub = self.client.pubsub()
        await pubsub.subscribe(self.keys.plan_channel)
        try:
            current = await self.current_plan()
            if current is not None and current.generation > last:
                last = current.generation
                yield current
            while not stopped.is_set():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                if message is None:
                    continue
                announcement = decode(PlanAnnouncement, message.get("data"), "agent.plan", MAX_PLAN_BYTES)
                if announcement is not None and announcement.generation > last:
                    last = announcement.generation
                    yield announcement
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
