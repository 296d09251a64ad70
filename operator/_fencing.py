"""Fail-stop for one job: which nodes have failed (their pods, their heartbeats) and fencing them.

A node is fenced before any planning: its failure goes into the status (durable, so a restarted operator
plans around it without detecting it again), its pod is deleted at once and its heartbeat forgotten, so that
a worker that lost its heartbeat but still runs cannot come back with the weights of a generation the job
has left. The generation that leaves the fenced nodes out is the reconciler's to decide (`_reconfigure`).

Missing heartbeats count only while Redis has been up a full TTL (`RedisWatch.heartbeats_trusted`), and only
for nodes that have beaten: a node still starting is judged by its pod alone.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from resilientjob.protocol.keys import HEARTBEAT_TTL_S

from . import _decide, _manifests, api, metrics
from ._capacity import CapacityKeeper
from ._job_view import JobView
from ._pods import WorkerPods
from ._redis_state import HeartbeatScan
from ._redis_watch import REDIS_DOWN
from .kube import core_path

log = logging.getLogger("resilientjob.operator")


@dataclass(frozen=True, slots=True)
class Fenced:
    """A failed node already fenced, waiting for a generation that leaves it out."""

    reason: api.Reason
    cause: str
    detect_s: float | None
    """Seconds from its last sign of life to the fence (None: not known, as for a node fenced before a
    restart of the operator)."""


class Fencing:
    """One job's fenced nodes and when each node last showed life."""

    def __init__(self, ctl: JobView, workers: WorkerPods, capacity: CapacityKeeper) -> None:
        self.ctl = ctl
        self.workers = workers
        self.capacity = capacity
        self.fenced: dict[int, Fenced] = {}
        """Nodes fenced and not yet left out by a committed generation."""
        self.heartbeat_seen: dict[int, float] = {}
        """When each node last beat (monotonic, on Redis's clock as far as the TTL tells it)."""

    async def restore(self, fenced_nodes: Iterable[int], plan_nodes: Iterable[int]) -> None:
        """Nodes a restarted operator finds fenced in the status: those still in the layout are planned
        around without being detected again, and any pod of a fenced node still there is deleted. The fence
        is written before its pod is deleted (`fence`); an operator stopped between the two left a live pod
        that a later generation, having left the node out, took for a join (node ids are never reused, so
        no pod of a fenced node belongs)."""
        fenced = set(fenced_nodes)
        for node in fenced & set(plan_nodes):
            self.fenced.setdefault(node, Fenced(api.Reason.NODE_FAILED, "fenced before a restart", None))
        if not fenced:
            return
        listed = await self.ctl.kube.list(
            core_path(self.ctl.namespace, "pods"), _manifests.job_selector(self.ctl.name)
        )
        for pod in listed:
            view = _decide.pod_view(pod, self.ctl.name)
            if view is not None and view.node in fenced:
                log.info(
                    "job %s/%s: deleting the pod of fenced node %d",
                    self.ctl.namespace,
                    self.ctl.name,
                    view.node,
                )
                await self.ctl.kube.delete(self.workers.path(view.node), grace_period_s=0)
                self.workers.observe(pod, deleted=True)

    def keep_planned(self, plan_nodes: Iterable[int]) -> None:
        """Forget the fenced nodes a committed generation has left out."""
        planned = set(plan_nodes)
        self.fenced = {node: fenced for node, fenced in self.fenced.items() if node in planned}

    def expired(self, scan: HeartbeatScan) -> list[int]:
        """Nodes that have beaten (the agents' bitmap, or seen alive by this operator) and whose key has
        expired. A node that never beat (still starting) is judged by its pod alone."""
        now = time.monotonic()
        live = scan.live
        # When each live node last beat, on Redis's clock: the agents set the key with HEARTBEAT_TTL_S.
        beat_at = now - np.maximum(0.0, HEARTBEAT_TTL_S - scan.left_s[live])
        self.heartbeat_seen.update(zip(scan.nodes[live].tolist(), beat_at.tolist(), strict=True))
        if not self.ctl.watch.heartbeats_trusted(now):
            return []  # Redis was away, emptied or paused: its silence says nothing yet
        silent: list[int] = scan.nodes[~live].tolist()
        beaten = set(scan.expired)
        return [node for node in silent if node in beaten or node in self.heartbeat_seen]

    async def confirmed(
        self, failures: dict[int, tuple[api.Reason, str]]
    ) -> dict[int, tuple[api.Reason, str]]:
        """Re-read each suspected pod before fencing: the watch may lag behind our own creations."""
        confirmed: dict[int, tuple[api.Reason, str]] = {}
        for node, cause in failures.items():
            if cause[0] is api.Reason.NODE_FAILED and node not in self.workers.views:
                pod = await self.ctl.kube.get(self.workers.path(node))
                if pod is not None and _decide.pod_view(pod, self.ctl.name) is not None:
                    self.workers.observe(pod, deleted=False)
                    view = self.workers.views.get(node)
                    if view is not None and view.failed is None:
                        continue
            confirmed[node] = cause
        return confirmed

    async def fence(
        self, failures: dict[int, tuple[api.Reason, str]], last_seen: Mapping[int, float] | None = None
    ) -> None:
        """Fence each failed node: into the status (durable before the pod goes), its pod deleted at once,
        its heartbeat forgotten in Redis (a replacement must beat anew), a replacement asked for.
        `last_seen`: when a node last showed life (monotonic) where neither its pod nor its heartbeat tells
        it (a worker that hangs while its agent beats on, `_aborts`); its detection latency counts from
        there."""
        ctl = self.ctl
        detected = time.monotonic()
        for node, (reason, cause) in failures.items():
            since: float | None
            if last_seen is not None and node in last_seen:
                path, since = "hang", last_seen[node]
            elif reason is api.Reason.HEARTBEAT_EXPIRED:
                path, since = "heartbeat", self.heartbeat_seen.get(node)
            else:
                path, since = "pod", self.workers.seen_at.get(node)
            latency = max(0.0, detected - since) if since is not None else None
            if latency is not None:
                metrics.DETECTION_SECONDS.labels(path).observe(latency)
                metrics.RECOVERY_SECONDS.labels("detect").observe(latency)
            log.info("job %s/%s: fencing node %d (%s)", ctl.namespace, ctl.name, node, cause)
            if node not in ctl.status.fenced_nodes:  # durable before the pod goes (`restore`)
                fenced = sorted({*ctl.status.fenced_nodes, node})
                ctl.status = ctl.status.model_copy(update={"fenced_nodes": fenced})
                await ctl.write_status(force=True)
            self.capacity.fenced(ctl, node)
            await ctl.kube.delete(self.workers.path(node), grace_period_s=0)
            if ctl.redis is not None:
                with contextlib.suppress(
                    *REDIS_DOWN
                ):  # the fence is durable; a heartbeat left behind expires
                    await ctl.redis.fence(node)
            self.heartbeat_seen.pop(node, None)
            self.fenced[node] = Fenced(reason, cause, latency)
