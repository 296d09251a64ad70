"""The local Kubernetes API: kmock's KubernetesEmulator (real HTTP) with the few server behaviours the
operator relies on and the emulator leaves out: object metadata (uid, resourceVersion, creationTimestamp,
namespace), the resources kopf must discover, and owner-reference garbage collection. Used by the tests and
by `rjob local`; in a real cluster the API server does all of this.

Two changes make it scale to thousands of pods (kmock is built for tests of a few dozen requests): kmock
records every request for assertions and routes each new one by filtering that whole record, and it answers
reads and writes by scanning every stored object, so creating N pods cost O(N^2) (measured: 128 pods in 25 s,
1,024 in 437 s). Here a request is forgotten once answered, and single objects are looked up by key."""

from __future__ import annotations

import datetime
import itertools
import uuid
from typing import Any

import attrs
import kmock
from kmock._internal import enums, k8s_dicts, rendering
from kmock._internal.k8s import KubernetesObjectNotFoundError

from . import api

# (group/version/plural, kind, namespaced)
CORE_RESOURCES: tuple[tuple[str, str, bool], ...] = (
    ("v1/pods", "Pod", True),
    ("v1/events", "Event", True),
    ("v1/configmaps", "ConfigMap", True),
    ("v1/secrets", "Secret", True),
    ("v1/services", "Service", True),
    ("v1/namespaces", "Namespace", False),
    # kopf watches CRDs to learn when resources appear; without it, it never starts watching.
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False),
    ("kopf.dev/v1/kopfpeerings", "KopfPeering", True),
    ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False),
)
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


@attrs.define(kw_only=True)
class LocalApiServer(kmock.KubernetesEmulator):
    """The emulator plus metadata stamping and cascading deletion by owner uid."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources[f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"] = kmock.ResourceInfo(
            kind=api.KIND,
            singular=api.SINGULAR,
            namespaced=True,
            verbs=VERBS,
            shortnames={api.SHORT_NAME},
            subresources={"status"},
        )
        for resource, kind, namespaced in CORE_RESOURCES:
            plural = resource.rsplit("/", 1)[-1]
            subresources = {"status"} if kind == "Pod" else set()
            self.resources[resource] = kmock.ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=namespaced,
                verbs=VERBS,
                subresources=subresources,
            )
            del plural

    async def _handle(self, request: rendering.Request) -> Any:
        data = request.data if isinstance(request.data, dict) else None
        if request.resource is not None and data is not None:
            meta = data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:8]}"
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", _now())
                meta.setdefault("generation", 1)
                if request.namespace and not meta.get("namespace"):
                    meta["namespace"] = request.namespace
            if request.action in (enums.action.CREATE, enums.action.UPDATE):
                meta["resourceVersion"] = str(next(self._versions))
        deleted_uid = self._uid_of(request) if request.action == enums.action.DELETE else None
        try:
            response = await super()._handle(request)
        finally:
            self._forget(request)
        if deleted_uid is not None:
            await self._collect(deleted_uid)
        return response

    def _forget(self, request: rendering.Request) -> None:
        """Drop an answered request from kmock's records, the server's and the serving reaction's (only
        requests still in flight stay: routing a request filters the whole server record, so a growing record
        makes every request slower, and a long-running local stack would keep every request in memory)."""
        for record in (self._requests, *(payload._requests for payload in self._payloads)):
            for index in range(len(record) - 1, -1, -1):
                if record[index] is request:
                    del record[index]
                    break

    def _lookup(self, request: rendering.Request) -> k8s_dicts.Object:
        """The one object a named request addresses, by key instead of kmock's scan of every object."""
        if request.resource is None or request.name is None:
            raise KubernetesObjectNotFoundError()
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects._objects:
            raise KubernetesObjectNotFoundError()
        return self._objects._objects[key]

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            obj = self._lookup(request)
        if obj.deleted:
            raise KubernetesObjectNotFoundError()
        return obj.raw

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        data = request.data if isinstance(request.data, dict) else {}
        meta = data.get("metadata", {})
        named = rendering.Request(
            resource=request.resource,
            namespace=request.namespace or meta.get("namespace"),
            name=request.name or meta.get("name"),
        )
        async with self._lock:
            return self._lookup(named).raw

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            return self._lookup(request).last.raw

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            return self._lookup(request).last.raw

    def _uid_of(self, request: rendering.Request) -> str | None:
        if request.resource is None or request.name is None:
            return None
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        uid = (self.objects[key].get("metadata") or {}).get("uid")
        return str(uid) if uid else None

    async def _collect(self, owner_uid: str) -> None:
        """Delete (through the normal path, so watchers see DELETED) every object owned by `owner_uid`."""
        owned = []
        for (resource, namespace, name), obj in list(self.objects.items()):
            if obj.deleted:
                continue
            refs = (obj.get("metadata") or {}).get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                owned.append((resource, namespace, name))
        for resource, namespace, name in owned:
            prefix = "/api/v1" if resource.group == "" else f"/apis/{resource.group}/{resource.version}"
            await self.delete(f"{prefix}/namespaces/{namespace}/{resource.plural}/{name}")


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
