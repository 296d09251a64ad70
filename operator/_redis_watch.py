"""How the operator tells "Redis says this node is silent" from "Redis could not tell" (issue #14).

A missing heartbeat key is evidence only while Redis has been up, reachable and answering promptly for a
whole heartbeat TTL, plus the agents' longest reconnect backoff: after an outage, a restart that came back
empty, or a pause (SIGSTOP, a stalled host: every agent's renewal waited as long as our own call), each agent
needs up to `BACKOFF_CAP_S` to reconnect and then a beat to rewrite its key. Until then nobody is fenced for
a missing heartbeat; pod events from Kubernetes still count.

`RedisWatch` also paces the job loop's retries (capped exponential backoff) and logs one line when an
outage starts and one when it ends, never one per retry. `forget_job` deletes a deleted job's keys.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass, field

import kopf
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from resilientjob.protocol.keys import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    HEARTBEAT_TTL_S,
    JobKeys,
    backoff_wait_s,
)

from . import api, metrics
from ._redis_state import JobRedis
from .kube import KubeApi, core_path

log = logging.getLogger("resilientjob.operator")

HEARTBEAT_GRACE_S = HEARTBEAT_TTL_S + BACKOFF_CAP_S
"""After Redis is back (or was found emptied), missing heartbeats are ignored this long."""

STALL_S = HEARTBEAT_TTL_S / 2
"""A Redis round trip this slow is a pause: the agents' own renewals may have waited as long, so their keys
may have expired without any of them dying."""


SOCKET_TIMEOUT_S = 5.0
"""The operator's Redis calls give up after this long (a paused server must not hold a job's loop forever)."""


REDIS_DOWN: tuple[type[BaseException], ...] = (RedisError, OSError)
"""What a Redis call raises while the server is away or not ready (ConnectionError, TimeoutError,
BusyLoadingError and an emptied server's refusals are all RedisError): retried, never fatal."""


def operator_client(url: str, password: str | None = None, *, bounded: bool = True) -> aioredis.Redis:
    """The operator's client for a job's Redis: the agents' settings plus a bound on every call (unless not
    `bounded`: the clean-up of a deleted job)."""
    client: aioredis.Redis = aioredis.Redis.from_url(
        url,
        password=password or None,
        socket_connect_timeout=2.0,
        socket_timeout=SOCKET_TIMEOUT_S if bounded else None,
        health_check_interval=10,
    )
    return client


async def job_client(
    kube: KubeApi, namespace: str, spec: api.ResilientJobSpec, default_url: str, *, bounded: bool = True
) -> aioredis.Redis:
    """The client for a job's Redis: its own (`spec.redis`, password from its Secret) or the operator's."""
    password = None
    ref = spec.redis.password_secret_ref
    if ref is not None:
        secret = await kube.get(core_path(namespace, "secrets", ref.name))
        value = ((secret or {}).get("data") or {}).get(ref.key)
        if value is None:
            raise kopf.TemporaryError(f"Secret {ref.name!r} key {ref.key!r} not found", delay=5.0)
        password = base64.b64decode(value).decode()
    return operator_client(spec.redis.url or default_url, password, bounded=bounded)


def heartbeats_trusted(now: float, back_at: float | None) -> bool:
    """Whether missing heartbeats count at `now`, Redis having last come back at `back_at` (None: never
    lost since this operator started)."""
    return back_at is None or now - back_at >= HEARTBEAT_GRACE_S


def backoff_s(failures: int, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> float:
    """The wait before the next try after `failures` failures in a row: capped exponential, full jitter."""
    if failures <= 0:
        return 0.0
    return backoff_wait_s(failures, base_s, cap_s)


@dataclass(slots=True)
class RedisWatch:
    """One job's view of its Redis: `failed` on every error, `ok` after every successful round trip."""

    what: str
    failures: int = 0
    """Failed passes in a row."""
    outages: int = 0
    back_at: float | None = None
    """When Redis last came back (or was found emptied); None while it was never lost."""
    _down_since: float = field(default=0.0, repr=False)

    @property
    def down(self) -> bool:
        return self.failures > 0

    def failed(self, exc: BaseException) -> float:
        """Note a failed pass; returns the wait before the next one. Logs once per outage."""
        self.failures += 1
        if self.failures == 1:
            self._down_since = time.monotonic()
            self.outages += 1
            metrics.REDIS_OUTAGES.labels(self.what).inc()
            reason = str(exc).splitlines()[0][:200] if str(exc) else ""
            log.warning(
                "job %s: Redis unreachable (%s: %s); missing heartbeats are ignored until it is back",
                self.what,
                type(exc).__name__,
                reason,
            )
        return backoff_s(self.failures)

    def round_trip(self, started: float, finished: float) -> None:
        """Note a Redis call that began at `started` and answered at `finished` (monotonic): a slow one was
        a pause. Only the call's own duration counts: a loop slowed by the Kubernetes API between two calls
        is no pause of Redis (the agents' renewals did not wait on it)."""
        if finished - started >= STALL_S:
            log.warning(
                "job %s: Redis answered after %.1f s (paused?); heartbeats count again in %.1f s",
                self.what,
                finished - started,
                HEARTBEAT_GRACE_S,
            )
            self.back_at = finished

    def ok(self) -> float | None:
        """Note a successful pass: ends an outage (one log line) and starts the heartbeats' grace. The
        outage's length when this ended one, else None."""
        if not self.failures:
            return None
        now = time.monotonic()
        log.warning(
            "job %s: Redis is back after %.1f s; heartbeats count again in %.1f s",
            self.what,
            now - self._down_since,
            HEARTBEAT_GRACE_S,
        )
        self.failures = 0
        self.back_at = now
        return now - self._down_since

    def lost_state(self) -> None:
        """Redis answered but its state was gone or garbled (a restart that came back empty): the agents
        are re-registering, so their heartbeats get the same grace as after an outage."""
        self.back_at = time.monotonic()

    def heartbeats_trusted(self, now: float | None = None) -> bool:
        """Whether missing heartbeats count now: not during an outage, and not in the pass that ends one
        (its scan is the first answer; `ok` starts the grace only after the pass). Judged there, a key that
        expired while Redis was away, or one a restarted Redis reloaded already expired, fenced a live
        worker."""
        if self.failures:
            return False
        return heartbeats_trusted(time.monotonic() if now is None else now, self.back_at)


async def forget_job(redis_url: str, namespace: str, name: str, password: str | None = None) -> int:
    """Delete a deleted job's Redis keys."""
    return await forget_keys(operator_client(redis_url, password, bounded=False), namespace, name)


async def forget_keys(client: aioredis.Redis, namespace: str, name: str) -> int:
    """Delete a deleted job's Redis keys with `client`, then close it."""
    try:
        return await JobRedis(client, JobKeys(namespace, name)).forget()
    finally:
        await client.aclose()
