"""The agent's telemetry: heartbeats (a key with a TTL, renewed every 0.5 s), iteration times into a capped
Redis stream, per-worker change-point detection with slow reports to the operator, and the plan it must run
(current generation by key, new generations by pub/sub). Everything read back is validated and bad input is
dropped and counted; nothing here raises on hostile data.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import RedisError

from ._redis import HEARTBEAT_TTL_S, STREAM_MAXLEN, JobKeys
from .telemetry_messages import (
    MAX_PLAN_BYTES,
    Heartbeat,
    IterationRecord,
    PlanAnnouncement,
    SlowReport,
    decode,
    encode,
)

HEARTBEAT_INTERVAL_S = 0.5

STEP_SECONDS = Histogram(
    "rjob_agent_step_seconds",
    "Wall time of one training step on this worker.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
SAMPLES_PER_SECOND = Gauge("rjob_agent_samples_per_second", "Samples/s processed by this worker.")
GENERATION = Gauge("rjob_agent_plan_generation", "Plan generation this worker runs.")
HEARTBEATS = Counter("rjob_agent_heartbeats_total", "Heartbeats written.")
HEARTBEAT_ERRORS = Counter("rjob_agent_heartbeat_errors_total", "Heartbeats that failed to reach Redis.")
SLOW_REPORTS = Counter("rjob_agent_slow_reports_total", "Fail-slow change points reported.", ["kind"])


@dataclass(slots=True)
class LevelShiftDetector:
    """Per-worker change-point detection on iteration times: a shift of the recent median against a
    baseline median by more than `threshold`, held for `confirm` consecutive steps.

    This is the seam for the planner's fail-slow detectors (planner.failslow, BOCD + verification): they
    take the same input (one iteration time at a time) and answer the same question (a new level?).
    """

    threshold: float = 1.1
    baseline_window: int = 20
    recent_window: int = 5
    confirm: int = 3
    _baseline: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=5))
    _streak: int = 0
    _slow: bool = False
    _baseline_level: float = 0.0

    def __post_init__(self) -> None:
        if self.threshold <= 1:
            raise ValueError(f"threshold must be > 1, got {self.threshold}")
        if self.recent_window < 1 or self.baseline_window < self.recent_window or self.confirm < 1:
            raise ValueError("windows must satisfy 1 <= recent_window <= baseline_window and confirm >= 1")
        self._baseline = deque(maxlen=self.baseline_window)
        self._recent = deque(maxlen=self.recent_window)

    @property
    def slow(self) -> bool:
        return self._slow

    @property
    def baseline_level(self) -> float:
        """The normal step time the last change point was measured against."""
        return self._baseline_level

    def reset(self) -> None:
        """Forget the baseline: a new layout has a new normal step time."""
        self._baseline.clear()
        self._recent.clear()
        self._streak = 0
        self._slow = False

    def update(self, seconds: float) -> float | None:
        """Feed one step time; returns the slowdown ratio when a change point is confirmed (a ratio < 1
        means it recovered), else None."""
        self._recent.append(seconds)
        if not self._slow and len(self._baseline) < self.recent_window:
            self._baseline.append(seconds)
            return None
        base = self._baseline_level if self._slow else statistics.median(self._baseline)
        ratio = statistics.median(self._recent) / base
        shifted = ratio < self.threshold if self._slow else ratio >= self.threshold
        self._streak = self._streak + 1 if shifted else 0
        if not self._slow and not shifted:
            self._baseline.append(seconds)
        if self._streak < self.confirm:
            return None
        self._streak = 0
        self._slow = not self._slow
        self._baseline_level = base
        if not self._slow:
            self._recent.clear()
        return ratio


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
        detector: LevelShiftDetector | None = None,
    ) -> None:
        if not 0 < heartbeat_interval_s < heartbeat_ttl_s:
            raise ValueError("heartbeat_interval_s must be > 0 and below heartbeat_ttl_s")
        self.client = client
        self.keys = keys
        self.node = node
        self.pod = pod
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.detector = detector or LevelShiftDetector()
        self.generation = -1
        self.step = 0

    async def beat(self) -> None:
        message = Heartbeat(
            node=self.node, pod=self.pod, generation=self.generation, step=self.step, sent_at=time.time()
        )
        await self.client.set(
            self.keys.heartbeat(self.node), encode(message), px=int(self.heartbeat_ttl_s * 1000)
        )
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

    async def record_iteration(
        self, generation: int, step: int, seconds: float, samples: int
    ) -> SlowReport | None:
        """Append one step to the job's iteration stream; report a change point when the detector sees one."""
        if generation != self.generation:
            self.detector.reset()
            self.generation = generation
            GENERATION.set(generation)
        self.step = step
        STEP_SECONDS.observe(seconds)
        SAMPLES_PER_SECOND.set(samples / seconds)
        record = IterationRecord(
            node=self.node,
            generation=generation,
            step=step,
            seconds=seconds,
            samples=samples,
            sent_at=time.time(),
        )
        await self.client.xadd(
            self.keys.iterations, {"m": encode(record)}, maxlen=STREAM_MAXLEN, approximate=True
        )
        ratio = self.detector.update(seconds)
        if ratio is None:
            return None
        report = SlowReport(
            node=self.node,
            generation=generation,
            step=step,
            slowdown=ratio,
            baseline_s=self.detector.baseline_level,
            recovered=not self.detector.slow,
            detected_at=time.time(),
        )
        await self.client.xadd(
            self.keys.reports, {"m": encode(report)}, maxlen=STREAM_MAXLEN, approximate=True
        )
        SLOW_REPORTS.labels(report.kind).inc()
        return report

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
