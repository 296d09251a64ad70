"""The operator's side of Redis for one job: the plan as the commit point of every generation (compare-and-
set, then pub/sub), heartbeat liveness, and the iteration and fail-slow report streams.

Built for thousands of agents per job on one core: each liveness scan is ONE server-side script call that
returns every node's TTL packed as 4-byte integers, plus the committed generation (so the large plan is
read and validated only when it changed); stream reads return their messages length-framed in one string.

It also carries the fail-slow side channel: the agents' profiles and validation results (streams), the
validation request (a key the operator sets), and the fail-slow episode's state (one JSON key, with the
report stream's cursor, so a restarted operator neither loses the episode nor replays old reports).
Without hiredis, redis-py parses replies in Python at tens of microseconds per element; a scan of 4,096
PTTLs in a pipeline cost ~0.1 s of operator CPU, the packed reply costs well under a millisecond.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from resilientjob.planner.plan import Plan
from resilientjob.protocol.keys import HEARTBEAT_TTL_S, JobKeys
from resilientjob.protocol.messages import (
    MAX_PLAN_BYTES,
    DropReason,
    IterationRecord,
    PlanAnnouncement,
    ProfileRecord,
    SlowReport,
    ValidationRequest,
    ValidationResult,
    ValidationTopology,
    WorkerAbort,
    count_drop,
    decode,
    encode,
    workload_termination,
)

from . import metrics

M = TypeVar("M", IterationRecord, SlowReport, ProfileRecord, ValidationResult)

MAX_FAILSLOW_STATE_BYTES = 4 * 2**20
"""The episode state is a few KiB; anything larger in its key was not written by the operator."""


def announcement(
    plan: Plan,
    trigger: str = "",
    nodes: Iterable[int] = (),
    reason: str = "",
    *,
    strategy: str = "",
    detect_s: float = 0.0,
    steps: tuple[int, int] | None = None,
    parked: Iterable[int] = (),
    restore: Plan | None = None,
) -> PlanAnnouncement:
    return PlanAnnouncement(
        generation=plan.generation,
        layout=plan.layout,
        policy=str(plan.policy),
        plan=plan,
        published_at=time.time(),
        trigger=trigger,
        nodes=sorted(nodes),
        reason=reason,
        strategy=strategy,
        detect_s=round(max(0.0, detect_s), 6),
        onset_step=None if steps is None else steps[0],
        detected_step=None if steps is None else steps[1],
        parked=sorted(set(parked)),
        restore=restore,
    )


# ARGV: heartbeat key prefix, nodes as "1,2,5", beaten-bitmap key, plan-generation key, heartbeat TTL in ms,
# plan key, owner key, the job's uid ("": none claimed), aborts hash. The owner key is set back to the uid
# when it holds anything else (a Redis that reloaded an older state naming a deleted job of this name would
# have every agent of this one refused, `agent.telemetry.BEAT`; this operator runs the job, so its uid is
# the owner). Returns the packed big-endian int32 PTTL of every node (-2: no key), the packed "has ever
# beaten" bytes (0/1), the committed generation, the nodes whose key had no TTL, as "1,5", the plan's length
# (-1: another type), which tells a plan overwritten in place without reading it, and how many aborts wait
# (the hash is read only when there are some; -1: the key holds another type). An agent always sets its key
# with a TTL, so a key without one is garbage (hand-written, another type): it gets the TTL of a fresh beat
# instead of being obeyed, so a live agent overwrites it and a dead node's key still expires. Reads of keys
# holding another type (GETBIT, GET) count as absent. Keys are derived from the job prefix, so a Redis
# Cluster needs the job's keys in one slot (a hash tag in the prefix); a single server needs nothing.
_SCAN = """
local ttls, beaten, repaired, i = {}, {}, {}, 0
for node in string.gmatch(ARGV[2], "%d+") do
  i = i + 1
  local key = ARGV[1] .. node
  local left = redis.call("PTTL", key)
  if left == -1 then
    redis.call("PEXPIRE", key, ARGV[5])
    left = tonumber(ARGV[5])
    repaired[#repaired + 1] = node
  end
  ttls[i] = struct.pack(">i4", left)
  if left >= 0 then
    beaten[i] = "\1"
  else
    local bit = redis.pcall("GETBIT", ARGV[3], node)
    if type(bit) ~= "number" then bit = 0 end
    beaten[i] = string.char(bit)
  end
end
if ARGV[8] ~= "" and redis.pcall("GET", ARGV[7]) ~= ARGV[8] then
  redis.call("SET", ARGV[7], ARGV[8])
end
local generation = redis.pcall("GET", ARGV[4])
if type(generation) ~= "string" then generation = "" end
local size = redis.pcall("STRLEN", ARGV[6])
if type(size) ~= "number" then size = -1 end
local aborts = redis.pcall("HLEN", ARGV[9])
if type(aborts) ~= "number" then aborts = -1 end
return {table.concat(ttls), table.concat(beaten), generation, table.concat(repaired, ","), size, aborts}
"""

# KEYS[1]: a stream; ARGV: exclusive start id, count. Returns the last id read and every entry's "m" field
# framed as a big-endian uint32 length + bytes (0xFFFFFFFF: the entry had no "m" field).
_READ = """
local entries = redis.call("XRANGE", KEYS[1], "(" .. ARGV[1], "+", "COUNT", ARGV[2])
local parts, last = {}, ARGV[1]
for i, entry in ipairs(entries) do
  last = entry[1]
  local fields, value = entry[2], nil
  for j = 1, #fields, 2 do
    if fields[j] == "m" then value = fields[j + 1] break end
  end
  if value == nil then
    parts[i] = struct.pack(">I4", 4294967295)
  else
    parts[i] = struct.pack(">I4", #value) .. value
  end
end
return {last, table.concat(parts)}
"""
_NO_FIELD = 0xFFFFFFFF
_STREAM_ID = re.compile(r"\d+-\d+")


@dataclass(frozen=True, slots=True)
class HeartbeatScan:
    """One liveness scan of a job's nodes (arrays aligned with `nodes`)."""

    nodes: np.ndarray
    """Node ids scanned (int64)."""
    left_s: np.ndarray
    """Seconds left on each heartbeat key; negative when there is no live key."""
    beaten: np.ndarray
    """True where the node has beaten at some time (bitmap set by the agents, or alive now)."""
    generation: int | None
    """The committed generation, or None when the generation key is missing or not a number."""
    repaired: tuple[int, ...] = ()
    """Nodes whose heartbeat key held garbage (no TTL): given a fresh TTL instead of being judged."""
    plan_bytes: int | None = None
    """The plan key's length (0: missing, -1: another type)."""
    aborts: int = 0
    """Fields in the job's aborts hash (`JobRedis.aborts` reads them); -1: the key holds another type."""

    @property
    def live(self) -> np.ndarray:
        mask: np.ndarray = self.left_s >= 0
        return mask

    @property
    def expired(self) -> list[int]:
        """Nodes that have beaten and whose key is gone: a missed heartbeat, not a worker still starting."""
        dead: list[int] = self.nodes[~self.live & self.beaten].tolist()
        return dead


@dataclass(frozen=True, slots=True)
class RedisPlan:
    """The plan key as found: absent, garbage (present, `message` None) or a valid announcement."""

    present: bool
    message: PlanAnnouncement | None
    generation_key: int | None = None
    """The generation key beside it (None: missing or not a number)."""


def node_list(nodes: Sequence[int]) -> str:
    """The scan's node argument (built once per generation by the caller)."""
    return ",".join(str(int(node)) for node in nodes)


@dataclass(frozen=True, slots=True)
class Published:
    """A committed generation with what every pass needs from it, computed once per generation."""

    message: PlanAnnouncement
    nodes: np.ndarray
    nodes_arg: str
    plan_nodes: frozenset[int]
    idle: frozenset[int]
    """Plan nodes that compute nothing (a replica S2 drained): their steps are probe products."""
    watched: frozenset[int]
    size: int
    """Bytes of the plan key holding it (a scan that finds another size finds the key overwritten)."""

    @classmethod
    def of(cls, message: PlanAnnouncement) -> Published:
        nodes = message.plan.nodes
        return cls(
            message=message,
            nodes=np.asarray(nodes, dtype=np.int64),
            nodes_arg=node_list(nodes),
            plan_nodes=frozenset(nodes),
            idle=frozenset(message.plan.idle_nodes),
            watched=frozenset(nodes) | frozenset(message.parked),
            size=len(encode(message)),
        )


class JobRedis:
    """One job's keys, through one client."""

    def __init__(self, client: aioredis.Redis, keys: JobKeys) -> None:
        self.client = client
        self.keys = keys
        self._iterations_cursor = "$"
        self.reports_cursor = "0-0"
        self._profiles_cursor = "$"
        self._results_cursor = "0-0"
        self._scan = client.register_script(_SCAN)
        self._read_script = client.register_script(_READ)
        self._garbage_logged: set[str] = set()
        self.uid = ""
        """The uid of the job that claimed the keys (`claim`); "" before."""

    async def close(self) -> None:
        await self.client.aclose()

    async def published(self) -> PlanAnnouncement | None:
        """The committed plan, or None before the first one (or when the key holds garbage)."""
        return (await self.read_plan()).message

    async def read_plan(self) -> RedisPlan:
        """The plan key and the generation key beside it, telling a missing key from garbage."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.plan)
            pipe.get(self.keys.plan_generation)
            raw, generation = await pipe.execute(raise_on_error=False)
        if isinstance(raw, ResponseError):  # WRONGTYPE: overwritten with another type
            return RedisPlan(present=True, message=None)
        message = decode(PlanAnnouncement, raw, "operator.plan", MAX_PLAN_BYTES)
        try:
            number: int | None = int(generation)
        except (TypeError, ValueError):
            number = None
        return RedisPlan(present=raw is not None, message=message, generation_key=number)

    async def announce(self, message: PlanAnnouncement, failslow: dict[str, Any] | None = None) -> None:
        """Set the plan (already recorded durably) and announce it, unconditionally: the durable record is
        the commit point, Redis its mirror. `failslow` (a mitigation's episode state) goes in the same
        transaction."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.plan, encode(message))
            pipe.set(self.keys.plan_generation, str(message.generation))
            pipe.publish(self.keys.plan_channel, encode(message))
            if self.uid:
                # A Redis that lost its state gets its owner back with the plan: agents of a deleted job of
                # this name are refused again (`claim`).
                pipe.set(self.keys.owner, self.uid, nx=True)
            if failslow is not None:
                pipe.set(self.keys.failslow, self._failslow_payload(failslow))
            await pipe.execute()

    async def republish(self, message: PlanAnnouncement) -> None:
        """Announce again (after a restart) for workers that missed the first announcement."""
        await self.client.publish(self.keys.plan_channel, encode(message))

    async def scan(self, nodes: np.ndarray, nodes_arg: str) -> HeartbeatScan:
        """Every node's heartbeat TTL and whether it ever beat, and the committed generation, in one call.
        The heartbeat's content is not trusted or needed: the TTL is the signal, and (TTL set - TTL left)
        dates the last beat on Redis's own clock. `nodes_arg` is `node_list(nodes)`."""
        ttl_ms = str(int(HEARTBEAT_TTL_S * 1000))
        reply: Any = await self._scan(
            args=[
                self.keys.heartbeat_prefix,
                nodes_arg,
                self.keys.beaten,
                self.keys.plan_generation,
                ttl_ms,
                self.keys.plan,
                self.keys.owner,
                self.uid,
                self.keys.aborts,
            ]
        )
        packed, beaten, generation, repaired_arg, plan_bytes, aborts = reply
        left = np.frombuffer(packed, dtype=">i4").astype(np.float64) / 1000.0
        if len(left) != len(nodes):
            raise ValueError(f"heartbeat scan returned {len(left)} values for {len(nodes)} nodes")
        flags = np.frombuffer(beaten, dtype=np.uint8).astype(bool)
        try:
            committed: int | None = int(generation)
        except ValueError:
            committed = None
        repaired = tuple(int(node) for node in repaired_arg.split(b",") if node)
        for node in repaired:
            self.garbage("heartbeat", self.keys.heartbeat(node), "given the TTL of a fresh beat")
        return HeartbeatScan(
            nodes=nodes,
            left_s=left,
            beaten=flags,
            generation=committed,
            repaired=repaired,
            plan_bytes=int(plan_bytes),
            aborts=int(aborts),
        )

    async def aborts(self, generation: int) -> dict[int, WorkerAbort]:
        """The nodes whose workers abandoned a step of `generation` (`WorkerAbort`, by node). The fields of
        older generations, of generations past the next (aborts follow commits), and any that do not decode
        or do not match their field's name, are deleted; so is the key when it holds another type (the
        agents' reports would fail on it)."""
        try:
            raw: dict[bytes | str, bytes | str] = await self.client.hgetall(self.keys.aborts)
        except ResponseError:  # WRONGTYPE
            self.garbage("abort", self.keys.aborts, "not a hash: deleted")
            await self.client.delete(self.keys.aborts)
            return {}
        found: dict[int, WorkerAbort] = {}
        stale: list[bytes | str] = []
        for field, value in raw.items():
            abort = decode(WorkerAbort, value, "operator.aborts")
            named = field.decode(errors="replace") if isinstance(field, bytes) else field
            if abort is None or named != f"{abort.generation}:{abort.node}":
                self.garbage("abort", f"{self.keys.aborts} {named}", "deleted")
                stale.append(field)
            elif abort.generation < generation or abort.generation > generation + 1:
                stale.append(field)
            elif abort.generation == generation:
                found[abort.node] = abort
        if stale:
            await self.client.hdel(self.keys.aborts, *stale)
        return found

    def garbage(self, kind: str, key: str, what: str) -> None:
        """Count an undecodable value (`rjob_redis_repairs_total{kind}`); log it once per key."""
        metrics.REDIS_REPAIRS.labels(self.keys.job, kind).inc()
        if key not in self._garbage_logged:
            self._garbage_logged.add(key)
            logging.getLogger("resilientjob.operator").warning(
                "job %s/%s: undecodable value in Redis key %s: %s",
                self.keys.namespace,
                self.keys.job,
                key,
                what,
            )

    async def live_heartbeats(self, nodes: Iterable[int]) -> dict[int, float]:
        """Nodes whose heartbeat key exists, with the seconds left on its TTL (one scan)."""
        ordered = np.asarray(list(nodes), dtype=np.int64)
        if not len(ordered):
            return {}
        scan = await self.scan(ordered, node_list(ordered.tolist()))
        live = scan.live
        return dict(zip(ordered[live].tolist(), scan.left_s[live].tolist(), strict=True))

    async def workload_error(self) -> tuple[int, str, str] | None:
        """(node, field, line) of the first node whose agent said the job's spec stopped its worker, or
        None (entries that do not parse are ignored: nothing read from Redis is trusted)."""
        raw = await self.client.hgetall(self.keys.workload_errors)
        found = []
        for key, value in raw.items():
            try:
                node = int(key)
                text = value.decode() if isinstance(value, bytes) else str(value)
                parsed = workload_termination(text[:8192])
            except (ValueError, UnicodeDecodeError):
                continue
            if parsed is not None and node >= 0:
                found.append((node, *parsed))
        return min(found) if found else None

    async def fence(self, node: int) -> None:
        """Forget a fenced node's heartbeat: a replacement must beat anew before its silence counts."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.heartbeat(node))
            pipe.setbit(self.keys.beaten, node, 0)
            await pipe.execute()

    async def new_iterations(self, count: int = 5000) -> list[IterationRecord]:
        """Iteration records appended since the last call (the first call starts at the stream's end)."""
        return await self._read(
            self.keys.iterations, "_iterations_cursor", count, "operator.iterations", IterationRecord
        )

    async def latest_iteration(self) -> IterationRecord | None:
        """The newest iteration record in the stream, whether or not it was read (None: none, or one that
        does not parse): what a restarted operator knows of the training before its first new record."""
        last: Any = await self.client.xrevrange(self.keys.iterations, count=1)
        if not last or not isinstance(last[0][1], dict):
            return None
        raw = last[0][1].get(b"m")
        return decode(IterationRecord, raw, "operator.iterations") if isinstance(raw, bytes) else None

    async def new_reports(self, count: int = 1000) -> list[SlowReport]:
        """Slow reports since `reports_cursor` (from the start, or where a restored episode left off)."""
        return await self._read(self.keys.reports, "reports_cursor", count, "operator.reports", SlowReport)

    async def new_profiles(self, count: int = 5000) -> list[ProfileRecord]:
        """Profiles appended since the last call (the first call starts at the stream's end)."""
        return await self._read(
            self.keys.profiles, "_profiles_cursor", count, "operator.profiles", ProfileRecord
        )

    async def new_validation_results(self, count: int = 100) -> list[ValidationResult]:
        """Validation results since the last call (the caller matches them by request id)."""
        return await self._read(
            self.keys.validation_results, "_results_cursor", count, "operator.validation", ValidationResult
        )

    async def request_validation(
        self,
        generation: int,
        suspects: Iterable[int],
        reason: str,
        topology: ValidationTopology = ValidationTopology.RING,
    ) -> ValidationRequest:
        """Set the next validation request; its id is one above the last one (ids only grow, also across
        operator restarts: the last request is read back from its key)."""
        last = decode(
            ValidationRequest, await self.client.get(self.keys.validation_request), "operator.request"
        )
        request = ValidationRequest(
            id=(last.id if last is not None else 0) + 1,
            generation=generation,
            topology=topology,
            suspects=sorted(set(suspects)),
            reason=reason[:1024],
            requested_at=time.time(),
        )
        await self.client.set(self.keys.validation_request, encode(request))
        return request

    def _failslow_payload(self, state: dict[str, Any]) -> str:
        payload = {"state": state, "reports_cursor": self.reports_cursor}
        return json.dumps(payload, separators=(",", ":"))

    async def save_failslow(self, state: dict[str, Any]) -> None:
        """Store the fail-slow episode's state with the report cursor it is consistent with."""
        await self.client.set(self.keys.failslow, self._failslow_payload(state))

    async def load_failslow(self) -> dict[str, Any] | None:
        """The stored episode state, moving the report cursor to where it was saved; None when there is
        none or it is unreadable (counted as dropped: the episode then starts over, as before)."""
        raw = await self.client.get(self.keys.failslow)
        if raw is None:
            return None
        try:
            if len(raw) > MAX_FAILSLOW_STATE_BYTES:
                raise ValueError("oversized")
            payload = json.loads(raw)
            state = payload["state"]
            cursor = str(payload["reports_cursor"])
            if not isinstance(state, dict) or not _STREAM_ID.fullmatch(cursor):
                raise ValueError("malformed")
        except (ValueError, KeyError, TypeError):
            count_drop("operator.failslow", DropReason.INVALID)
            return None
        self.reports_cursor = cursor
        return state

    async def _read(self, stream: str, cursor_attr: str, count: int, source: str, model: type[M]) -> list[M]:
        try:
            return await self._read_stream(stream, cursor_attr, count, source, model)
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
        # The stream was overwritten with another type: the agents' appends fail on it too. Delete it; their
        # next append makes a new stream, read from its start.
        await self.client.delete(stream)
        setattr(self, cursor_attr, "0-0")
        self.garbage("telemetry", stream, "not a stream: deleted (the agents' next entry starts it again)")
        return []

    async def _read_stream(
        self, stream: str, cursor_attr: str, count: int, source: str, model: type[M]
    ) -> list[M]:
        cursor = getattr(self, cursor_attr)
        if cursor == "$":
            # Start from the newest entry: the operator needs recent throughput, not the history.
            last: Any = await self.client.xrevrange(stream, count=1)
            setattr(self, cursor_attr, last[0][0].decode() if last else "0-0")
            return []
        reply: Any = await self._read_script(keys=[stream], args=[cursor, count])
        last, framed = reply
        setattr(self, cursor_attr, last.decode())
        out: list[M] = []
        offset, size = 0, len(framed)
        while offset + 4 <= size:
            (length,) = struct.unpack_from(">I", framed, offset)
            offset += 4
            if length == _NO_FIELD:
                count_drop(source, DropReason.INVALID)
                self.garbage("telemetry", stream, "an entry without its message field: ignored")
                continue
            decoded = decode(model, framed[offset : offset + length], source)
            offset += length
            if decoded is not None:
                out.append(decoded)
            else:
                self.garbage("telemetry", stream, "an undecodable entry: ignored")
        return out

    async def claim(self, uid: str, started: bool = False) -> int:
        """Make the keys this job's (`uid`, the ResilientJob's): keys another job of the same name left (its
        deletion raced its agents, which wrote on: their heartbeat bitmap then fenced the new job's workers
        as they started) are deleted. How many were; 0 when the keys were this job's already. The owner key
        is set first: from then on those agents' beats and store registrations are refused (they check it,
        `agent.telemetry.BEAT`), so none slips in between the deletion and the claim.

        `started`: the job has published a plan before (its status says so). Keys without an owner are then
        its own agents', written into a Redis that lost its state, and are kept: a restarted operator
        wiped them, and logged that a deleted job had left them."""
        self.uid = uid
        owner = await self.client.get(self.keys.owner)
        if owner is None and started:
            await self.client.set(self.keys.owner, uid)
            return 0
        if owner is not None and _text(owner) == uid:
            return 0
        # "claiming:" until the leftovers are gone: it refuses the old agents already, and a claim cut short
        # (Redis away in the middle of the deletion) finds it on its retry and deletes the rest.
        await self.client.set(self.keys.owner, f"claiming:{uid}")
        removed = await self.forget(keep=self.keys.owner)
        await self.client.set(self.keys.owner, uid)
        return removed

    async def forget(self, keep: str | None = None) -> int:
        """Delete every key of the job (on job deletion), but `keep`."""
        removed = 0
        async for key in self.client.scan_iter(match=f"{self.keys.prefix}*", count=500):
            if keep is None or _text(key) != keep:
                removed += await self.client.delete(key)
        return removed


def _text(value: bytes | str) -> str:
    """A Redis reply as text (the client may or may not decode replies)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
