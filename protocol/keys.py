"""Every Redis key and channel of a job: the layout the agents and the operator share.

Every key of a job lives under `rjob:{namespace/job}:` so that one Redis can serve many jobs and an ACL
can confine each job's agents to their own prefix. The braces are a Redis Cluster hash tag: only
`namespace/job` is hashed, so all of a job's keys sit in one slot and the operator's Lua scan (which builds
heartbeat keys from the prefix) and its MULTI/EXEC commit may touch them together.

The timing constants both sides rely on live here too: the operator fences a node only after a heartbeat
TTL plus the agents' longest backoff has passed with Redis up. Part of `resilientjob.protocol` (standard
library only); the Redis clients themselves stay with the agent and the operator.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

HEARTBEAT_TTL_S = 2.0
"""A heartbeat key lives this long; agents renew it every 0.5 s, so three missed beats mean dead."""

STREAM_MAXLEN = 10_000
"""Iteration and report streams are capped (approximately) at this many entries."""

BACKOFF_BASE_S = 0.05
"""First retry delay of an agent's Redis loop during an outage."""

BACKOFF_CAP_S = 2.0
"""Longest retry delay of an agent's Redis loop during an outage."""


def backoff_ceiling_s(failures: int, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> float:
    """The longest wait before the next Redis try after `failures` failures in a row: doubling from
    `base_s`, capped at `cap_s`."""
    return min(cap_s, base_s * 2.0 ** min(max(failures - 1, 0), 30))


def backoff_wait_s(
    failures: int,
    base_s: float = BACKOFF_BASE_S,
    cap_s: float = BACKOFF_CAP_S,
    draw: Callable[[float, float], float] = random.uniform,
) -> float:
    """The wait before the next Redis try, drawn between `base_s / 2` and the ceiling (full jitter, so that
    a job's agents do not all reconnect in the same instant); `draw` is `random.uniform` or a seeded one."""
    return draw(base_s / 2, backoff_ceiling_s(failures, base_s, cap_s))


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

    @property
    def store(self) -> str:
        """`host:port` of the job's TCPStore (the store pod registers it)."""
        return f"{self.prefix}store"

    @property
    def store_failures(self) -> str:
        """The failures the job's store host announced so far: a new host (its pod was replaced) starts its
        store's failure counter there, so that the workers' failure notices stay right."""
        return f"{self.prefix}store:failures"

    @property
    def profile_request(self) -> str:
        """The operator's `ModelProfileRequest`."""
        return f"{self.prefix}model-profile:request"

    @property
    def profile_report(self) -> str:
        """Node 0's `ModelProfileReport`."""
        return f"{self.prefix}model-profile:report"

    @property
    def owner(self) -> str:
        """The uid of the ResilientJob these keys belong to: a new job of the same name finds another."""
        return f"{self.prefix}owner"

    @property
    def workload_errors(self) -> str:
        """Hash node -> the line of a workload error that stopped its worker (`messages.workload_termination`
        reads it): set before the agent stops beating, so the operator has it before the heartbeat expires."""
        return f"{self.prefix}workload-errors"

    @property
    def aborts(self) -> str:
        """Hash "<generation>:<node>" -> `WorkerAbort`: a node whose workers abandoned a step of that
        generation on a communication error, alive and waiting for the next generation (`operator/_aborts`).
        The operator deletes the fields of generations it has left."""
        return f"{self.prefix}aborts"

    @property
    def failslow(self) -> str:
        """The operator's fail-slow state (its detectors and the report stream's cursor)."""
        return f"{self.prefix}failslow"
