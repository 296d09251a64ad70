"""The agent's telemetry: heartbeats (a key with a TTL, renewed every 0.5 s), iteration times into a capped
Redis stream, per-worker change-point detection (the planner's BOCD + verification,
`planner.failslow.ChangeDetector`) with slow and recovery reports to the operator, and the plan it must run
(current generation by key, new generations by pub/sub). Everything read back is validated and bad input is
dropped and counted; nothing here raises on hostile data.

Nothing here raises when Redis goes away either (`_redis.Outage`): heartbeats retry with capped backoff
and rewrite their key and bit when Redis is back (also when it came back empty), iteration records and
profiles made meanwhile are dropped (the operator reads fresh ones once Redis is back), slow reports wait
in a small outbox until they can be sent, and the plan follower resubscribes and re-reads the plan key.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Hashable
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram

from resilientjob.planner.failslow import ChangeDetector, ChangeEvent, ChangeKind, DetectorConfig
from resilientjob.protocol.keys import HEARTBEAT_TTL_S, STREAM_MAXLEN, JobKeys
from resilientjob.protocol.messages import (
    MAX_PLAN_BYTES,
    Heartbeat,
    IterationRecord,
    PlanAnnouncement,
    ProfileRecord,
    SlowKind,
    SlowReport,
    decode,
    encode,
    export_drop_counts,
)

from ._redis import REDIS_DOWN, Outage

HEARTBEAT_INTERVAL_S = 0.5

WARMUP_STEPS = 5
"""Steps not fed to the detectors after (re)starting detection: the first steps of a worker or of a new
role carry start-up costs (allocations, first collectives of new groups) that are no fail-slow."""

PARKED_ROLE = "probe"
"""The role of a parked node's probe step (`_parked`): the plan leaves the node out."""
DRAINED_ROLE = "drained"
"""The role of a step on a node whose replica fail-slow S2 drained (`_worker_probe`): the plan runs no
micro-batch there, and the step's compute is a probe product on the node's device."""
PROBE_ROLES = frozenset({PARKED_ROLE, DRAINED_ROLE})
"""Roles whose compute is a probe product on a node out of the step: a recovery counts only against the
probe's first level in the role (`Telemetry._probe_recovery`)."""
WALL_BLIND_ROLES = frozenset({DRAINED_ROLE})
"""Roles whose step wall says nothing of the node: a drained node waits out its peers' step, so only its
compute (the probe) is watched. (A change in the job's step would read as the node's recovery, and the
operator, which has no level of a drained node to weigh it against, would take its word.)"""

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
TELEMETRY_DROPPED = Counter(
    "rjob_agent_telemetry_dropped_total", "Iteration records and profiles not sent because Redis was away."
)


export_drop_counts()

PLAN_RECHECK_S = 2.0
"""The plan follower re-reads the plan key this often besides listening on the channel."""

OUTBOX_SIZE = 64
"""Slow reports kept while Redis is away (the oldest go first past this)."""


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
        self.outage = Outage(f"agent node {node}", cap_s=heartbeat_interval_s)
        """Shared by everything this agent sends or reads: one log line per outage; the heartbeat loop is
        the one that notices Redis is back (it tries every interval), the other writes skip meanwhile."""
        self.outbox: deque[tuple[str, bytes]] = deque(maxlen=OUTBOX_SIZE)
        """Slow reports made while Redis was away, sent before the next write once it is back."""

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
        """Beat until `stopped`. Redis away is never fatal: the beat is retried with capped backoff (at most
        the beat interval apart, so beats resume within one interval of Redis coming back), and each beat
        rewrites the key and the node's `beaten` bit, which re-registers the node in a Redis that came back
        empty. The slow reports that waited meanwhile go out after the first beat that gets through."""
        while not stopped.is_set():
            wait_s = self.heartbeat_interval_s
            try:
                await self.beat()
                self.outage.ok()
                await self._flush()
            except REDIS_DOWN as exc:
                HEARTBEAT_ERRORS.inc()
                wait_s = self.outage.failed(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), wait_s)

    async def _flush(self) -> None:
        while self.outbox:
            stream, message = self.outbox[0]
            await self.client.xadd(stream, {"m": message}, maxlen=STREAM_MAXLEN, approximate=True)
            self.outbox.popleft()

    async def _send(self, stream: str, message: bytes, *, keep: bool) -> bool:
        """Append `message` to `stream`; False when Redis is away. A `keep` message (a slow report) waits
        in the outbox meanwhile; the others are dropped and counted (they are superseded within seconds)."""
        if not self.outage.down:
            try:
                await self._flush()
                await self.client.xadd(stream, {"m": message}, maxlen=STREAM_MAXLEN, approximate=True)
                return True
            except REDIS_DOWN as exc:
                self.outage.failed(exc)
        if keep:
            self.outbox.append((stream, message))
        else:
            TELEMETRY_DROPPED.inc()
        return False

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
        chaos_s: float | None = None,
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
        a detector in its warm-up cannot see a change yet.

        `chaos_s` (the delay a chaos order added to the step) travels in the record for whoever measures a
        slowdown ordered on purpose (`rjob demo`, the benches); the detectors never read it."""
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
            chaos_s=chaos_s or None,
        )
        await self._send(self.keys.iterations, encode(record), keep=False)
        if self._skipped < self.warmup:
            self._skipped += 1
            return None
        compute_event = None
        if compute_s is not None:
            self._computes.append(compute_s)
            compute_event = self.compute_detector.feed(compute_s)
            if compute_event is not None and key in PROBE_ROLES:
                compute_event = self._probe_recovery(compute_event)
        step_event = None if key in WALL_BLIND_ROLES else self.detector.feed(seconds)
        if compute_event is not None:
            return await self._report(generation, step, compute_event, SlowKind.COMPUTE)
        if step_event is None:
            return None
        if compute_s is None:
            return await self._report(generation, step, step_event, SlowKind.COMPUTE)
        if self._compute_moved(step_event.index):
            return None  # the compute detector owns this change (reported already, or soon)
        return await self._report(generation, step, step_event, SlowKind.COMMUNICATION)

    def _probe_recovery(self, event: ChangeEvent) -> ChangeEvent | None:
        """A probe's change as it counts: a recovery only when the level falls under the probe's first level
        in this role by the detector's margin. The detector judges against its last level, so a passing
        bump (cache contention from the workers sharing the host's cores) read as a recovery when it ended:
        the demo's drained x4 worker was restored at its slowed level while its order held. A slowdown of a
        node already out of the step changes nothing and goes as it is."""
        if event.kind is not ChangeKind.RECOVERY:
            return event
        first = statistics.median(self._computes[: self.detector_config.baseline])
        return event if event.after_s * (1 + self.detector_config.min_change) <= first else None

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
        await self._send(self.keys.reports, encode(report), keep=True)
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
        await self._send(self.keys.profiles, encode(record), keep=False)
        return record

    async def current_plan(self) -> PlanAnnouncement | None:
        raw = await self.client.get(self.keys.plan)
        return decode(PlanAnnouncement, raw, "agent.plan", MAX_PLAN_BYTES)

    async def plan_updates(self, stopped: asyncio.Event) -> AsyncIterator[PlanAnnouncement]:
        """New generations as the operator publishes them (pub/sub fast path), in increasing order. Redis
        away ends no iteration: the subscription is made anew with backoff and the current key re-read, so
        that no generation published meanwhile is skipped silently."""
        last = self.generation
        while not stopped.is_set():
            pubsub = self.client.pubsub()
            found: list[PlanAnnouncement] = []
            try:
                await pubsub.subscribe(self.keys.plan_channel)
                current = await self.current_plan()
                if current is not None and current.generation > last:
                    found.append(current)
                checked = time.monotonic()
                while not stopped.is_set():
                    if time.monotonic() - checked > PLAN_RECHECK_S:
                        # A subscription the client re-made by itself after a blip misses what was
                        # published meanwhile: the key says.
                        checked = time.monotonic()
                        current = await self.current_plan()
                        if current is not None and current.generation > last:
                            found.append(current)
                    for announcement in found:
                        if announcement.generation > last:  # the key and the channel may both say it
                            last = announcement.generation
                            yield announcement
                    found.clear()
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                    if message is None:
                        continue
                    heard = decode(PlanAnnouncement, message.get("data"), "agent.plan", MAX_PLAN_BYTES)
                    if heard is not None and heard.generation > last:
                        found.append(heard)
            except REDIS_DOWN as exc:
                wait_s = self.outage.failed(exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopped.wait(), wait_s)
            finally:
                with contextlib.suppress(*REDIS_DOWN):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
