"""The agent's telemetry: heartbeats (a key with a TTL, renewed every 0.5 s), iteration times into a capped
Redis stream, per-worker change-point detection (the planner's BOCD + verification,
`planner.failslow.ChangeDetector`) with slow and recovery reports to the operator, and the plan it must run
(current generation by key, new generations by pub/sub). Everything read back is validated and bad input is
dropped and counted; nothing here raises on hostile data.

Nothing here raises when Redis goes away either (`_redis.Outage`): heartbeats retry with capped backoff
and rewrite their key and bit when Redis is back (also when it came back empty), iteration records and
profiles made meanwhile are dropped (the operator reads fresh ones once Redis is back), slow reports wait
in a small outbox until they can be sent, and the plan follower resubscribes and re-reads the plan key.

Beats and appends are fenced by the job's uid (`BEAT`, `SEND`): an agent of a deleted job of the same
name (a pod stuck terminating on a node cut off from the API server but not from Redis) finds the keys
owned by the new job, has its writes refused and stops after `SUPERSEDED_AFTER_S`, instead of keeping a
dead node of the new job alive or feeding it a deleted job's steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram

from resilientjob.planner.failslow import DetectorConfig
from resilientjob.protocol.keys import HEARTBEAT_TTL_S, STREAM_MAXLEN, JobKeys
from resilientjob.protocol.messages import (
    MAX_PLAN_BYTES,
    Heartbeat,
    IterationRecord,
    PlanAnnouncement,
    ProfileRecord,
    SlowReport,
    WorkerAbort,
    abort_line,
    decode,
    encode,
    export_drop_counts,
)

from ._redis import REDIS_DOWN, Outage
from ._step_watch import (
    AGENT_DETECTOR,
    DRAINED_ROLE,
    PARKED_ROLE,
    PROBE_ROLES,
    WALL_BLIND_ROLES,
    WARMUP_STEPS,
    StepChange,
    StepWatch,
)

__all__ = [
    "AGENT_DETECTOR",
    "DRAINED_ROLE",
    "PARKED_ROLE",
    "PROBE_ROLES",
    "WALL_BLIND_ROLES",
    "WARMUP_STEPS",
    "StepChange",
    "StepWatch",
    "Superseded",
    "Telemetry",
    "queue_beat",
]

HEARTBEAT_INTERVAL_S = 0.5

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


# ARGV[uid] is the writer's job uid ("": unknown, as for an agent started by hand), KEYS[owner] the job's
# owner key: the script returns 0 and writes nothing when the owner names another job. Only the operator
# sets the owner, to the uid of the job it runs, so a live agent of the current job is never refused.
_OWNER_FENCE = """
if ARGV[{uid}] ~= "" then
  local owner = redis.pcall("GET", KEYS[{owner}])
  if type(owner) == "string" and owner ~= ARGV[{uid}] then return 0 end
end
"""

# KEYS: the node's heartbeat key, the job's `beaten` bitmap, the owner key. ARGV: the beat, its TTL in ms,
# the node, the uid. The bit is set with PCALL: a bitmap key overwritten with another type must not stop
# the beat that keeps the node alive.
BEAT = (
    _OWNER_FENCE.format(uid=4, owner=3)
    + """
redis.call("SET", KEYS[1], ARGV[1], "PX", ARGV[2])
redis.pcall("SETBIT", KEYS[2], ARGV[3], 1)
return 1
"""
)


def queue_beat(
    client: Any, keys: JobKeys, node: int, message: bytes, ttl_s: float = HEARTBEAT_TTL_S, job_uid: str = ""
) -> Any:
    """One heartbeat (`BEAT`) on a client or pipeline, async or sync: the key with its TTL and the node's
    bit in the job's `beaten` bitmap, unless the keys belong to another job than `job_uid`. Returns what
    the client's `eval` returns (1 written, 0 refused, once executed). One round trip per beat, or per
    batch of agents when one process drives many."""
    return client.eval(
        BEAT, 3, keys.heartbeat(node), keys.beaten, keys.owner, message, int(ttl_s * 1000), node, job_uid
    )


# KEYS: a stream, the owner key. ARGV: the message, the stream's approximate cap, the uid. The same fence
# as `BEAT` for everything an agent appends (step records, slow reports): a deleted job's agent must not
# feed the new job's detectors or date its generations.
SEND = (
    _OWNER_FENCE.format(uid=3, owner=2)
    + """
redis.call("XADD", KEYS[1], "MAXLEN", "~", ARGV[2], "*", "m", ARGV[1])
return 1
"""
)

# KEYS: the job's aborts hash, the owner key. ARGV: the abort, its field ("<generation>:<node>"), the uid.
ABORT = (
    _OWNER_FENCE.format(uid=3, owner=2)
    + """
redis.call("HSET", KEYS[1], ARGV[2], ARGV[1])
return 1
"""
)

SUPERSEDED_AFTER_S = 5.0
"""How long the keys must stay another job's before an agent stops: the operator sets the owner back within
a pass when it was wrong (a Redis that reloaded an older state naming a deleted job), and a deleted job's
agent stops within this."""


SUPERSEDED_EXIT = 3
"""Exit code of an agent or store host whose job's Redis keys belong to a newer job of the same name."""


class Superseded(Exception):
    """The job's Redis keys belong to another job of the same name: this agent's job was deleted."""


@dataclass(slots=True)
class Refusals:
    """How long the job's keys have named another job, as one writer sees it (agent or store host)."""

    after_s: float = SUPERSEDED_AFTER_S
    since: float | None = None
    """When refusals began; None while the keys are this job's."""

    def note(self, owned: bool, now: float | None = None) -> bool:
        """Note one check; True once refusals have lasted `after_s` (one alone may be a Redis that
        reloaded an older owner, which the operator sets back within a pass)."""
        if owned:
            self.since = None
            return False
        now = time.monotonic() if now is None else now
        self.since = now if self.since is None else self.since
        return now - self.since >= self.after_s


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
        job_uid: str = "",
        superseded_after_s: float = SUPERSEDED_AFTER_S,
    ) -> None:
        if not 0 < heartbeat_interval_s < heartbeat_ttl_s:
            raise ValueError("heartbeat_interval_s must be > 0 and below heartbeat_ttl_s")
        self.client = client
        self.keys = keys
        self.node = node
        self.pod = pod
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.job_uid = job_uid
        """The uid of the ResilientJob this agent works for (RJOB_JOB_UID); "" writes unfenced."""
        self.superseded = False
        """The keys have belonged to another job for the grace (`Refusals`): nothing is written any more."""
        self.refusals = Refusals(superseded_after_s)
        """Since when writes have been refused (the keys another job's)."""
        self.watch = StepWatch(detector or AGENT_DETECTOR, warmup)
        """The detectors on this worker's steps; `role` None until the first step."""
        self.generation = -1
        self.step = 0
        self.outage = Outage(f"agent node {node}", cap_s=heartbeat_interval_s)
        """Shared by everything this agent sends or reads: one log line per outage; the heartbeat loop is
        the one that notices Redis is back (it tries every interval), the other writes skip meanwhile."""
        self.outbox: deque[tuple[str, bytes]] = deque(maxlen=OUTBOX_SIZE)
        """Slow reports made while Redis was away, sent before the next write once it is back."""
        self.waiting: WorkerAbort | None = None
        """This node's abandoned step while its workers wait for a newer generation: sent with every beat."""

    async def beat(self, ttl_s: float | None = None) -> None:
        """One heartbeat, alive for `ttl_s` (default `heartbeat_ttl_s`). Raises `Superseded` when the keys
        belong to another job (and from then on writes nothing)."""
        if self.superseded:
            raise Superseded(self._superseded_line())
        message = Heartbeat(
            node=self.node, pod=self.pod, generation=self.generation, step=self.step, sent_at=time.time()
        )
        ttl = ttl_s or self.heartbeat_ttl_s
        written = await queue_beat(self.client, self.keys, self.node, encode(message), ttl, self.job_uid)
        self._owned(written != 0)
        if written:
            HEARTBEATS.inc()

    def _owned(self, accepted: bool) -> None:
        """Note whether a write was accepted; raises `Superseded` once refusals have lasted the grace
        (`Refusals`). Says when refusals begin and end."""
        refused_before = self.refusals.since is not None
        if self.refusals.note(accepted):
            self.superseded = True
            raise Superseded(self._superseded_line())
        if accepted and refused_before:
            print(f"resilientjob.agent: node {self.node}: the job's Redis keys are its own again", flush=True)
        elif not accepted and not refused_before:
            print(
                f"resilientjob.agent: node {self.node}: Redis refuses this pod's writes: the keys name "
                f"another job of this name; stopping in {self.refusals.after_s:.0f} s unless that changes",
                flush=True,
            )

    def _superseded_line(self) -> str:
        return (
            f"node {self.node}: the Redis keys of job {self.keys.namespace}/{self.keys.job} belong to "
            f"another ResilientJob of that name; this pod's job (uid {self.job_uid}) was deleted: it stops"
        )

    async def heartbeat_forever(self, stopped: asyncio.Event) -> None:
        """Beat until `stopped`. Redis away is never fatal: the beat is retried with capped backoff (at most
        the beat interval apart, so beats resume within one interval of Redis coming back), and each beat
        rewrites the key and the node's `beaten` bit, which re-registers the node in a Redis that came back
        empty. The slow reports that waited meanwhile go out after the first beat that gets through.

        Keys owned by another job for `SUPERSEDED_AFTER_S` (`Superseded`) end the loop and set `stopped`:
        the whole agent stops."""
        while not stopped.is_set():
            wait_s = self.heartbeat_interval_s
            try:
                await self.beat()
                self.outage.ok()
                await self._flush()
                if self.waiting is not None:
                    await self._send_abort(self.waiting)
            except REDIS_DOWN as exc:
                HEARTBEAT_ERRORS.inc()
                wait_s = self.outage.failed(exc)
            except Superseded as exc:
                print(f"resilientjob.agent: {exc}", flush=True)
                stopped.set()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), wait_s)

    async def _append(self, stream: str, message: bytes) -> bool:
        """XADD through the owner fence (`SEND`); False when refused."""
        written = await self.client.eval(
            SEND, 2, stream, self.keys.owner, message, STREAM_MAXLEN, self.job_uid
        )
        return bool(written)

    async def _flush(self) -> None:
        while self.outbox:
            stream, message = self.outbox[0]
            await self._append(stream, message)  # refused: the report was for a job that is gone
            self.outbox.popleft()

    async def _send(self, stream: str, message: bytes, *, keep: bool) -> bool:
        """Append `message` to `stream`; False when Redis is away. A `keep` message (a slow report) waits
        in the outbox meanwhile; the others are dropped and counted (they are superseded within seconds).
        Nothing is sent once the keys belong to another job."""
        if self.superseded or self.refusals.since is not None:
            return False
        if not self.outage.down:
            try:
                await self._flush()
                return await self._append(stream, message)
            except REDIS_DOWN as exc:
                self.outage.failed(exc)
        if keep:
            self.outbox.append((stream, message))
        else:
            TELEMETRY_DROPPED.inc()
        return False

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
        switch: tuple[float, float, int] | None = None,
        probe_s: float | None = None,
    ) -> SlowReport | None:
        """Append one step to the job's iteration stream; report a change point when a detector sees one
        (`StepWatch.feed`: `compute_s` is the step's time outside communication, from the trace).

        `role` is what this worker computes (its stages and micro-batches, or a probe step when the plan
        does not use it); detection starts over when it changes, since the normal step time changes with
        it, and ignores the first `warmup` steps after (start-up noise). Without a role every new generation
        starts over. Keeping the detectors across generations that leave this worker's work alone matters:
        a detector in its warm-up cannot see a change yet.

        `chaos_s` (the delay a chaos order added to the step) travels in the record for whoever measures a
        slowdown ordered on purpose (`rjob demo`, the benches); the detectors never read it. `switch`: the
        (rendezvous s, copy s, bytes received) of this node's switch to `generation`, sent with its first
        step there. `probe_s`: the node's reference probe, when this step timed one
        (`_worker_probe.REFERENCE_EVERY_S`)."""
        key = role if role is not None else generation
        if self.waiting is not None and generation > self.waiting.generation:
            self.waiting = None  # the workers got the generation they waited for
        if generation != self.generation:
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
            rendezvous_s=None if switch is None else max(0.0, switch[0]),
            copy_s=None if switch is None else max(0.0, switch[1]),
            copied_bytes=None if switch is None else max(0, int(switch[2])),
            probe_s=probe_s if probe_s is not None and 0 < probe_s <= 3600 else None,  # nan: none
        )
        await self._send(self.keys.iterations, encode(record), keep=False)
        change = self.watch.feed(step, key, seconds, compute_s)
        return None if change is None else await self._report(generation, step, change)

    async def _report(self, generation: int, step: int, change: StepChange) -> SlowReport:
        report = change.report(self.node, generation, step, time.time())
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
        """Send one per-group profile of the recent window (`trace_reader.profile`, groups in node ids)."""
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

    async def record_abort(
        self,
        generation: int,
        step: int,
        error: str,
        collective_timeout_s: float,
        plan_timeout_s: float,
        switching: bool = False,
    ) -> WorkerAbort | None:
        """Tell the operator that this node's workers abandoned `step` of `generation` (or the switch to it:
        `switching`) on a communication error and wait for the next generation (`operator/_aborts`). The
        report is sent again with every heartbeat until this node steps in a newer generation: one lost to a
        Redis hiccup (a network fault often breaks both at once) would get this node taken for hung. None
        when it could not be sent now (Redis away, the keys another job's, or values no `WorkerAbort`
        holds)."""
        try:
            abort = WorkerAbort(
                node=self.node,
                generation=generation,
                step=step,
                error=abort_line(error),
                collective_timeout_s=collective_timeout_s,
                plan_timeout_s=plan_timeout_s,
                at=time.time(),
                switching=True if switching else None,
            )
        except ValueError as exc:  # a pydantic ValidationError: a bug here, not the operator's to trust
            print(f"resilientjob.agent: abort of step {step} not reported: {exc}", flush=True)
            return None
        self.waiting = abort
        try:
            return abort if await self._send_abort(abort) else None
        except REDIS_DOWN as exc:
            self.outage.failed(exc)
            return None

    async def _send_abort(self, abort: WorkerAbort) -> bool:
        if self.superseded:
            return False
        field = f"{abort.generation}:{abort.node}"
        written = await self.client.eval(
            ABORT, 2, self.keys.aborts, self.keys.owner, encode(abort), field, self.job_uid
        )
        return bool(written)

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
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
