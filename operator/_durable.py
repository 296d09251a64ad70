"""The durable record of a job's generations, and Redis rebuilt from it (issue #14).

The plan ConfigMap (`<job>-plan`, owned by the job) holds the whole announcement of the committed generation
and is written BEFORE the generation is announced in Redis: the ConfigMap write is the commit point, Redis
only its fast mirror. The CR status holds the rest of the record: the generation last applied and
`fencedNodes`, the nodes fenced and not taken back by a later generation, written before their pods are
deleted. So whatever Redis loses (a restart that comes back empty, a key overwritten with garbage), and
whenever the operator dies (SIGKILL right after a fence, between the two writes), the next pass finds the
decision in the durable record and finishes it exactly once:

- a new generation is numbered max(durable, Redis, status) + 1: nothing reused, nothing skipped;
- a plan key missing, undecodable or older than the record is set again from it (`rjob_redis_restores_total`,
  `rjob_redis_repairs_total{kind="plan"}`), and the agents, which re-register in an emptied Redis, continue;
- a plan key newer than the record (written by an operator from before this record existed) is adopted:
  it is recorded durably, never undone.

One operator writes a job's record at a time (kopf peering); the pure rules are `next_generation` and
`restore_action`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

from resilientjob.protocol.messages import MAX_PLAN_BYTES, PlanAnnouncement, decode

from . import _manifests, metrics
from ._redis_state import JobRedis, RedisPlan
from ._redis_watch import REDIS_DOWN, RedisWatch
from .kube import KubeApi, core_path

log = logging.getLogger("resilientjob.operator")


class RestoreAction(StrEnum):
    """What the committed plan in Redis needs, given the durable record."""

    NONE = "none"
    """Redis holds the recorded generation."""
    INITIAL = "initial"
    """No plan anywhere: the job plans generation 0 (or the one after its status)."""
    RESTORE = "restore"
    """The plan key is gone (Redis came back empty): set it from the record."""
    REPAIR = "repair"
    """The plan key (or the generation key beside it) holds garbage: replace it from the record."""
    ANNOUNCE = "announce"
    """Redis holds an older generation: the operator stopped (or Redis failed) between the two writes."""
    ADOPT = "adopt"
    """Redis holds a newer generation than the record: record it."""


def next_generation(*known: int | None) -> int:
    """The number of the next generation: one above the highest known anywhere (-1 or None: none)."""
    return max((g for g in known if g is not None), default=-1) + 1


def restore_action(durable: int | None, redis: RedisPlan) -> RestoreAction:
    """Pure: what to do with Redis's plan (`redis`) given the recorded generation (`durable`)."""
    if redis.message is None:
        if durable is None:
            return RestoreAction.INITIAL
        return RestoreAction.REPAIR if redis.present else RestoreAction.RESTORE
    generation = redis.message.generation
    if durable is None or generation > durable:
        return RestoreAction.ADOPT
    if generation < durable:
        return RestoreAction.ANNOUNCE
    return RestoreAction.NONE if redis.generation_key == generation else RestoreAction.REPAIR


def numbered(message: PlanAnnouncement, generation: int) -> PlanAnnouncement:
    """`message` as generation `generation` (the plan inside carries the number too)."""
    if message.generation == generation and message.plan.generation == generation:
        return message
    plan = message.plan.model_copy(update={"generation": generation})
    return message.model_copy(update={"generation": generation, "plan": plan})


def pods_to_create(
    message: PlanAnnouncement, applied: int, fenced: Iterable[int], nodes: int = 0
) -> list[int]:
    """The worker pods a (re)start creates: the plan's and the rest of the spec's `nodes` (ids 0..nodes-1:
    a first plan that leaves some idle; they wait as joins the planner declined, ready for a failure),
    until a generation was applied (`applied` < 0: the first start, or a crash before it finished); none
    afterwards. Never a fenced node's."""
    if applied >= 0:
        return []
    out = set(fenced)
    return sorted((set(message.plan.nodes) | set(range(nodes))) - out)


class PlanRecord:
    """One job's plan ConfigMap as the durable record, and Redis's plan key kept in line with it."""

    def __init__(self, kube: KubeApi, namespace: str, name: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.message: PlanAnnouncement | None = None
        self._loaded = False

    @property
    def generation(self) -> int | None:
        return None if self.message is None else self.message.generation

    def _path(self, collection: bool = False) -> str:
        if collection:
            return core_path(self.namespace, "configmaps")
        return core_path(self.namespace, "configmaps", _manifests.plan_configmap_name(self.name))

    async def load(self) -> PlanAnnouncement | None:
        """The recorded plan (read from the API once per process; this operator writes every later one)."""
        if self._loaded:
            return self.message
        body = await self.kube.get(self._path())
        raw = ((body or {}).get("data") or {}).get("plan.json")
        message = decode(PlanAnnouncement, raw, "operator.plan-configmap", MAX_PLAN_BYTES)
        if raw is not None and message is None:
            log.warning("job %s/%s: plan ConfigMap unreadable; Redis decides", self.namespace, self.name)
        if message is not None and (self.message is None or message.generation >= self.message.generation):
            self.message = message
        self._loaded = True
        return self.message

    async def write(self, body: Mapping[str, Any], message: PlanAnnouncement) -> None:
        """Record `message` (idempotent; an older generation never replaces a newer one)."""
        if self.message is not None and message.generation < self.message.generation:
            return
        if not await self.kube.create(self._path(collection=True), _manifests.plan_configmap(body, message)):
            await self.kube.patch(self._path(), {"data": _manifests.plan_configmap_data(message)})
        self.message = message
        self._loaded = True

    async def reconcile(
        self, redis: JobRedis, body: Mapping[str, Any], watch: RedisWatch
    ) -> PlanAnnouncement | None:
        """Bring Redis's plan in line with the record; the committed plan, or None when there is none."""
        await self.load()
        state = await redis.read_plan()
        action = restore_action(self.generation, state)
        key = redis.keys.plan
        if action is RestoreAction.INITIAL:
            if state.present:
                self._repaired(key, "no durable record to replace it from: planning anew")
            return None
        message = self.message
        if action is RestoreAction.ADOPT or message is None:
            if state.message is None:  # unreachable: restore_action adopts decoded plans only
                raise RuntimeError(f"restore_action: {action} without a plan")
            await self.write(body, state.message)
            return state.message
        if action is RestoreAction.NONE:
            return message
        await redis.announce(message)
        if action is RestoreAction.RESTORE:
            metrics.REDIS_RESTORES.labels(self.name).inc()
            watch.lost_state()
            log.warning(
                "job %s/%s: plan key missing in Redis (restarted empty?): restored generation %d from the "
                "plan ConfigMap",
                self.namespace,
                self.name,
                message.generation,
            )
        elif action is RestoreAction.REPAIR:
            watch.lost_state()
            self._repaired(key, f"replaced by generation {message.generation} from the plan ConfigMap")
        else:
            # Redis behind the record is how every decision passes (recorded first, then announced): no news.
            log.debug(
                "job %s/%s: Redis held generation %s, announced the recorded generation %d",
                self.namespace,
                self.name,
                state.message.generation if state.message else "?",
                message.generation,
            )
        return message

    async def commit(
        self,
        redis: JobRedis,
        body: Mapping[str, Any],
        message: PlanAnnouncement,
        current: int | None,
        applied: int,
        failslow: dict[str, Any] | None = None,
    ) -> PlanAnnouncement | None:
        """Commit a decision made on generation `current` (None: the first plan): numbered max(record,
        Redis, status `applied`) + 1, recorded, then announced in Redis (`failslow`, a mitigation's episode
        state, in the same transaction). None when the record has already moved past `current`: the
        decision was made on a superseded plan. Redis being away is no failure: the record is the commit,
        and `reconcile` announces it once Redis answers."""
        recorded = await self.load()
        if recorded is not None and current is not None and recorded.generation > current:
            log.info(
                "job %s/%s: generation %d already committed", self.namespace, self.name, recorded.generation
            )
            return None
        committed = numbered(message, next_generation(self.generation, current, applied))
        await self.write(body, committed)  # the commit point
        with contextlib.suppress(*REDIS_DOWN):
            await redis.announce(committed, failslow)
        return committed

    def _repaired(self, key: str, what: str) -> None:
        metrics.REDIS_REPAIRS.labels(self.name, "plan").inc()
        log.warning("job %s/%s: undecodable value in Redis key %s: %s", self.namespace, self.name, key, what)
