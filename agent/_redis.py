"""The agents' Redis client: the connection and how every agent-side loop rides out an outage.

`REDIS_DOWN` and `Outage` are how every agent-side loop rides out Redis going away (killed, restarted,
failed over, still loading its data): it retries with capped exponential backoff and jitter, logs one line
when the outage starts and one when it ends (no traceback, no line per retry), and keeps training meanwhile.
The key layout and the backoff bounds are the protocol's (`resilientjob.protocol.keys`).
"""

from __future__ import annotations

import random
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from resilientjob.protocol.keys import BACKOFF_BASE_S, BACKOFF_CAP_S, backoff_ceiling_s, backoff_wait_s

REDIS_DOWN: tuple[type[BaseException], ...] = (RedisError, OSError)
"""What a Redis call raises while the server is away or not ready (ConnectionError, TimeoutError,
BusyLoadingError and an emptied server's refusals are all RedisError): retried, never fatal."""


class Outage:
    """One Redis user's view of an outage: the backoff before its next try, one log line at the start of an
    outage and one at its end. `failed` on every error, `ok` after every success.

    One failure alone is no outage: after a restart every pooled connection fails once with "connection
    closed" while the server is already back, and a retry on a new connection succeeds. An outage starts at
    the second failure in a row (about `base_s` later); its time counts from the first."""

    def __init__(
        self,
        what: str,
        *,
        base_s: float = BACKOFF_BASE_S,
        cap_s: float = BACKOFF_CAP_S,
        jitter: random.Random | None = None,
    ) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"backoff: expected 0 < base_s <= cap_s, got {base_s} and {cap_s}")
        self.what = what
        self.base_s = base_s
        self.cap_s = cap_s
        self.jitter = jitter or random.Random()
        """Where the wait is drawn from; a test passes its own to see the ceiling."""
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
        return backoff_wait_s(self.failures, self.base_s, self.cap_s, self.jitter.uniform)

    def ceiling(self) -> float:
        """The longest wait after the failures so far: doubling from `base_s`, capped at `cap_s`."""
        return backoff_ceiling_s(self.failures, self.base_s, self.cap_s)

    def ok(self) -> bool:
        """Note a success; True when it ends an outage."""
        was_down, self.failures = self.down, 0
        if was_down:
            elapsed = time.monotonic() - self.first_failed_at
            print(f"{self.what}: Redis is back after {elapsed:.1f} s", flush=True)
        return was_down


def connect(url: str, password: str | None = None) -> aioredis.Redis:
    """A client for `url`; `password` (from the job's Secret) overrides one embedded in the URL."""
    client: aioredis.Redis = aioredis.Redis.from_url(
        url, password=password or None, socket_connect_timeout=2.0, health_check_interval=10
    )
    return client
