"""The operator's side of Redis for one job: the plan as the commit point of every generation (compare-and-
set, then pub/sub), heartbeat liveness, and the iteration and fail-slow report streams."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from resilientjob.agent._redis import JobKeys
from resilientjob.agent.telemetry_messages import (
    MAX_PLAN_BYTES,
    TELEMETRY_DROPPED,
    DropReason,
    IterationRecord,
    PlanAnnouncement,
    SlowReport,
    decode,
    encode,
)
from resilientjob.planner.plan import Plan


def announcement(
    plan: Plan,
    trigger: str = "",
    nodes: Iterable[int] = (),
    reason: str = "",
    *,
    strategy: str = "",
    detect_s: float = 0.0,
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
        parked=sorted(set(parked)),
        restore=restore,
    )


class JobRedis:
    """One job's keys, through one client."""

    def __init__(self, client: aioredis.Redis, keys: JobKeys) -> None:
        self.client = client
        self.keys = keys
        self._iterations_cursor = "$"
        self._reports_cursor = "0-0"

    async def close(self) -> None:
        await self.client.aclose()

    async def published(self) -> PlanAnnouncement | None:
        """The committed plan, or None before the first one (or when the key holds garbage)."""
        raw = await self.client.get(self.keys.plan)
        return decode(PlanAnnouncement, raw, "operator.plan", MAX_PLAN_BYTES)

    async def commit(
        self, message: PlanAnnouncement, expected_generation: int | None
    ) -> PlanAnnouncement | None:
        """Publish `message` only if the committed generation is still `expected_generation` (None: none yet).

        This is what makes a decision happen exactly once: an operator restarted mid-reconfiguration either
        finds its decision committed (and finishes applying it) or not (and decides again from scratch);
        two racing operators cannot both commit generation g+1. Returns the announcement when committed.
        """
        async with self.client.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(self.keys.plan)
                current = decode(
                    PlanAnnouncement, await pipe.get(self.keys.plan), "operator.plan", MAX_PLAN_BYTES
                )
                current_generation = current.generation if current is not None else None
                if current_generation != expected_generation:
                    return None
                pipe.multi()  # type: ignore[no-untyped-call]
                pipe.set(self.keys.plan, encode(message))
                pipe.publish(self.keys.plan_channel, encode(message))
                await pipe.execute()
            except WatchError:
                return None
        return message

    async def republish(self, message: PlanAnnouncement) -> None:
        """Announce again (after a restart) for workers that missed the first announcement."""
        await self.client.publish(self.keys.plan_channel, encode(message))

    async def live_heartbeats(self, nodes: Iterable[int]) -> dict[int, float]:
        """Nodes whose heartbeat key exists, with the seconds left on its TTL. The content is not trusted or
        needed: the TTL is the signal, and (TTL set - TTL left) dates the last beat on Redis's own clock."""
        ordered = list(nodes)
        if not ordered:
            return {}
        async with self.client.pipeline(transaction=False) as pipe:
            for node in ordered:
                pipe.pttl(self.keys.heartbeat(node))
            left = await pipe.execute()
        return {node: ms / 1000 for node, ms in zip(ordered, left, strict=True) if ms >= 0}

    async def new_iterations(self, count: int = 5000) -> list[IterationRecord]:
        """Iteration records appended since the last call (the first call starts at the stream's end)."""
        return [
            record
            for record in await self._read(
                self.keys.iterations, "_iterations_cursor", count, "operator.iterations", IterationRecord
            )
            if isinstance(record, IterationRecord)
        ]

    async def new_reports(self, count: int = 1000) -> list[SlowReport]:
        return [
            record
            for record in await self._read(
                self.keys.reports, "_reports_cursor", count, "operator.reports", SlowReport
            )
            if isinstance(record, SlowReport)
        ]

    async def _read(
        self,
        stream: str,
        cursor_attr: str,
        count: int,
        source: str,
        model: type[IterationRecord] | type[SlowReport],
    ) -> list[IterationRecord | SlowReport]:
        cursor = getattr(self, cursor_attr)
        if cursor == "$":
            # Start from the newest entry: the operator needs recent throughput, not the history.
            last: Any = await self.client.xrevrange(stream, count=1)
            setattr(self, cursor_attr, last[0][0].decode() if last else "0-0")
            return []
        replies: Any = await self.client.xread({stream: cursor}, count=count)
        out: list[IterationRecord | SlowReport] = []
        for _, entries in replies:
            for entry_id, fields in entries:
                setattr(self, cursor_attr, entry_id.decode())
                value = fields.get(b"m") if isinstance(fields, dict) else None
                decoded = decode(model, value, source)
                if decoded is not None:
                    out.append(decoded)
                elif value is None:
                    TELEMETRY_DROPPED.labels(source, DropReason.INVALID).inc()
        return out

    async def forget(self) -> int:
        """Delete every key of the job (on job deletion)."""
        removed = 0
        async for key in self.client.scan_iter(match=f"{self.keys.prefix}*", count=500):
            removed += await self.client.delete(key)
        return removed
