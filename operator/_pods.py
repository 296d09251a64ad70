"""A job's worker pods as its controller knows them, and the pod I/O of its generations.

The view is what the kopf pod watch delivered (`observe`), corrected by a periodic relist (`resync`), as an
informer's relist does: when a watch expires (410 Gone) kopf lists again and resumes from there, so a pod
deleted in the gap only shows as missing from a list. The I/O: create a generation's pods, patch their
generation annotations, delete them. Every change of the view sets the controller's `wakeup`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import _decide, _manifests
from .kube import KubeApi, KubeError, core_path

PATCH_CONCURRENCY = 32
"""Requests to the API server in flight at once when a generation creates or patches many pods."""
RESYNC_S = 5.0
"""How often a job's pods are listed again to catch deletions a watch gap hid (`resync`)."""


class WorkerPods:
    """One job's worker pods: node -> the last view of its pod, and when each node's pod was last seen."""

    def __init__(self, kube: KubeApi, namespace: str, job: str, wakeup: asyncio.Event) -> None:
        self.kube = kube
        self.namespace = namespace
        self.job = job
        self.views: dict[int, _decide.PodView] = {}
        self.seen_at: dict[int, float] = {}
        """Monotonic time of each node's last pod event (the fail-stop detection latency starts there)."""
        self._wakeup = wakeup
        self._listed_at = time.monotonic()

    def path(self, node: int) -> str:
        return core_path(self.namespace, "pods", _manifests.pod_name(self.job, node))

    def running(self, node: int) -> bool:
        """The node has a pod and it has not failed."""
        view = self.views.get(node)
        return view is not None and view.failed is None

    def working(self, node: int) -> bool:
        """The node's pod runs its worker: what the status counts as alive. A Pending pod (not scheduled,
        pulling its image) is not: an unschedulable job read `4/4` and "every node in use"."""
        view = self.views.get(node)
        return view is not None and view.failed is None and view.phase == "Running"

    def observe(self, pod: Mapping[str, Any], deleted: bool) -> None:
        """A watch event (or a pod read back) of one of the job's worker pods; others are ignored."""
        view = _decide.pod_view(pod, self.job)
        if view is None:
            return
        current = self.views.get(view.node)
        if deleted:
            # A DELETED event for an older incarnation must not hide its replacement.
            if current is not None and current.uid == view.uid:
                del self.views[view.node]
        else:
            self.views[view.node] = view
        self.seen_at[view.node] = time.monotonic()
        self._wakeup.set()

    async def resync(self) -> None:
        """Every `RESYNC_S`: forget pods the list no longer has. Pods seen after the list started are kept
        (our own new ones may be newer than the list)."""
        started = time.monotonic()
        if started - self._listed_at < RESYNC_S:
            return
        self._listed_at = started
        listed = await self.kube.list(core_path(self.namespace, "pods"), _manifests.job_selector(self.job))
        present = {str(pod["metadata"].get("uid")) for pod in listed}
        for node, view in list(self.views.items()):
            if view.uid not in present and self.seen_at.get(node, 0.0) < started:
                del self.views[node]
                self._wakeup.set()

    async def create(
        self, manifests: Iterable[dict[str, Any]], observe: Callable[[Mapping[str, Any], bool], None]
    ) -> None:
        """Create these pods (an existing one is left as it is), then read the job's pods back through
        `observe` (the controller's, which also sees its store pod), so that a pass right after does not
        take a pod the watch has not delivered yet for gone. When the server refuses some, the ones it took
        are read back all the same before the first refusal is raised: the caller counts what exists."""
        limit = asyncio.Semaphore(PATCH_CONCURRENCY)

        async def create(manifest: dict[str, Any]) -> None:
            async with limit:
                await self.kube.create(core_path(self.namespace, "pods"), manifest)

        done = await asyncio.gather(*(create(manifest) for manifest in manifests), return_exceptions=True)
        refused = next((result for result in done if isinstance(result, BaseException)), None)
        try:
            listed = await self.kube.list(
                core_path(self.namespace, "pods"), _manifests.job_selector(self.job)
            )
        except KubeError:
            if refused is None:
                raise
            listed = []  # the refusal is what to tell; the watch delivers the pods the server took
        for pod in listed:
            observe(pod, False)
        if refused is not None:
            raise refused

    async def annotate(self, nodes: Iterable[int], generation: int, layout: str) -> None:
        """Patch the generation annotations onto these nodes' pods; a pod that already shows the generation
        (created with it, or patched before an operator restart) is skipped."""
        patch = {"metadata": {"annotations": _manifests.generation_annotations(generation, layout)}}
        limit = asyncio.Semaphore(PATCH_CONCURRENCY)

        async def annotate(node: int) -> None:
            async with limit:
                await self.kube.patch(self.path(node), patch)

        wanted = str(generation)
        await asyncio.gather(
            *(
                annotate(node)
                for node in nodes
                if node in self.views and self.views[node].generation != wanted
            )
        )

    async def delete_all(self) -> None:
        """Every pod of the job (one that failed before its first plan: they never trained and hold
        devices)."""
        pods = await self.kube.list(core_path(self.namespace, "pods"), _manifests.job_selector(self.job))
        await asyncio.gather(
            *(self.kube.delete(core_path(self.namespace, "pods", p["metadata"]["name"])) for p in pods)
        )
        self.views.clear()
