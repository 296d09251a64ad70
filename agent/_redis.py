"""Redis connection and the key layout shared by the agents and the operator.

Every key of a job lives under `rjob:{namespace/job}:` so that one Redis can serve many jobs and an ACL
can confine each job's agents to their own prefix. The braces are a Redis Cluster hash tag: only
`namespace/job` is hashed, so all of a job's keys sit in one slot and the operator's Lua scan (which builds
heartbeat keys from the prefix) and its MULTI/EXEC commit may touch them together.

`REDIS_DOWN` and `Outage` are how every agent-side loop rides out Redis going away (killed, restarted,
failed over, still loading its data): it retries with capped exponential backoff and jitter, logs one line
when the outage starts and one when it ends (no traceback, no line per retry), and keeps training meanwhile.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

HEARTBEAT_TTL_S = 2.0
"""A heartbeat key lives this long; agents renew it every 0.5 s, so three missed beats mean dead."""

STREAM_MAXLEN = 10_000
"""Iteration and report streams are capped (approximately) at this many entries."""


REDIS_DOWN: tuple[type[BaseException], ...] = (RedisError, OSError)
"""What a Redis call raises while the server is away or not ready (ConnectionError, TimeoutError,
BusyLoadingError and an emptied server's refusals are all RedisError): retried, never fatal."""

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0


class Outage:
    """One Redis user's view of an outage: the backoff before its next try, one log line at the start of an
    outage and one at its end. `failed` on every error, `ok` after every success.

    One failure alone is no outage: after a restart every pooled connection fails once with "connection
    closed" while the server is already back, and a retry on a new connection succeeds. An outage starts at
    the second failure in a row (about `base_s` later); its time counts from the first."""

    def __init__(self, what: str, *, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"backoff: expected 0 < base_s <= cap_s, got {base_s} and {cap_s}")
        self.what = what
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures = 0
        """Failures in a row."""
        self.first_failed_at = 0.0
        self.outages = 0
        """Outages seen so far (an outage counts once however many retries it took)."""

    @property
    def down(self) -> bool:
        return self.failures >= 2

    def failed(self, exc: BaseException) -> float:
        """Note one failed call; returns how long to wait before the next try (capped exponential backoff
        with full jitter, so that a job's agents do not all reconnect in the same instant)."""
        self.failures += 1
        if self.failures == 1:
            self.first_failed_at = time.monotonic()
        elif self.failures == 2:
            self.outages += 1
            reason = str(exc).splitlines()[0][:200] if str(exc) else ""
            print(f"{self.what}: Redis unreachable ({type(exc).__name__}: {reason}); retrying", flush=True)
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 30))
        return random.uniform(self.base_s / 2, ceiling)

    def ok(self) -> bool:
        """Note a success; True when it ends an outage."""
        was_down, self.failures = self.down, 0
        if was_down:
            elapsed = time.monotonic() - self.first_failed_at
            print(f"{self.what}: Redis is back after {elapsed:.1f} s", flush=True)
        return was_down


@dataclass(frozen=True, slots=True)
class JobKeys:
    """Names of one job's Redis keys."""

    namespace: str
    job: str

    @property
    def prefix(self) -> str:
        # Kubernetes names cannot contain '/', '{' or '}', so the tag is unambiguous.
        return f"rjob:{{{self.namespace}/{self.job}}}:"

    def heartbeat(self, node: int) -> str:
        return f"{self.prefix}hb:{node}"

    @property
    def heartbeat_prefix(self) -> str:
        """`heartbeat(node)` is this prefix followed by the node number (the operator's scan builds keys)."""
        return f"{self.prefix}hb:"

    @property
    def beaten(self) -> str:
        """A bitmap with bit `node` set once that node has beaten: an agent sets it with every beat, so an
        operator that never caught a node's key alive (started late, restarted) still knows that a missing
        key means an expired heartbeat, not a worker that has not started yet."""
        return f"{self.prefix}hb-seen"

    @property
    def plan_generation(self) -> str:
        """The committed generation alone, written with the plan in one transaction: the operator checks it
        on every scan and reads (and validates) the large plan only when it changed."""
        return f"{self.prefix}plan-generation"

    @property
    def iterations(self) -> str:
        return f"{self.prefix}iters"

    @property
    def reports(self) -> str:
        return f"{self.prefix}reports"

    @property
    def plan(self) -> str:
        """The published plan (a PlanAnnouncement): the commit point of every generation."""
        return f"{self.prefix}plan"

    @property
    def plan_channel(self) -> str:
        """Pub/sub channel announcing each new generation: the fast path to the workers."""
        return f"{self.prefix}plan:events"

    @property
    def profiles(self) -> str:
        """Stream of `ProfileRecord`s (capped like the iteration stream)."""
        return f"{self.prefix}profiles"

    @property
    def validation_request(self) -> str:
        """The newest `ValidationRequest` (the operator sets it; the store host mirrors it to the workers)."""
        return f"{self.prefix}validate:request"

    @property
    def validation_results(self) -> str:
        """Stream of `ValidationResult`s, one per pass."""
        return f"{self.prefix}validate:results"

    def chaos(self, node: int) -> str:
        """Fault injection for the local stack: a slowdown factor with an expiry."""
        return f"{self.prefix}chaos:{node}"


def connect(url: str, password: str | None = None) -> aioredis.Redis:
    """A client for `url`; `password` (from the job's Secret) overrides one embedded in the URL."""
    client: aioredis.Redis = aioredis.Redis.from_url(
        url, password=password or None, socket_connect_timeout=2.0, health_check_interval=10
    )
    return client
