"""The object store of the local API server: kmock's objects array, written the way kube-apiserver and its
garbage collector write it.

- Every change gets a new `resourceVersion` and one watch event (none for a write that changes nothing).
- Deletion honours finalizers (the object stays with a `deletionTimestamp` until the last one is removed)
  and the propagation policy: Background (the default) removes the owner, then the garbage collector deletes
  every object whose last `ownerReference` pointed at it; Foreground adds the `foregroundDeletion` finalizer,
  deletes the dependents first and removes the owner when the last one is gone; Orphan drops the
  dependents' references to the owner and keeps them.
- A pod bound to a node (`spec.nodeName`) is deleted gracefully: it stays with a `deletionTimestamp` at the
  end of its grace period (the request's `gracePeriodSeconds`, else its `terminationGracePeriodSeconds`,
  else 30) until a delete with grace 0 removes it, as its node's kubelet sends once the containers stopped
  (or `kubectl delete --force` where that node is gone). An unbound pod goes at once.
- Deleting a namespace is the namespace controller's work too: the namespace is `Terminating` while
  everything in it is deleted (each object as its own deletion goes, finalizers holding it), and leaves
  once nothing is left in it.
- Removed objects leave the store (kmock keeps every version of every object, which a long-running local
  stack cannot afford), and an index by owner uid keeps collection from scanning every object.
"""

from __future__ import annotations

import collections
import copy
import datetime
from collections.abc import Iterator
from typing import Any

from kmock._internal import k8s_dicts, k8s_views, references

from ._local_api_watch import RecordingBus, Revisions

Key = tuple[references.resource, str | None, str]
FOREGROUND = "foregroundDeletion"
DEFAULT_GRACE_S = 30
"""A pod's `terminationGracePeriodSeconds` when its spec gives none."""


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owner_uids(obj: dict[str, Any]) -> set[str]:
    return {str(ref.get("uid")) for ref in (obj.get("metadata") or {}).get("ownerReferences") or ()}


class Store:
    def __init__(
        self,
        objects: k8s_views.ObjectsArray,
        buses: collections.defaultdict[references.resource, RecordingBus],
        revisions: Revisions,
        namespaces: references.resource,
    ) -> None:
        self._objects = objects
        self._namespaces = namespaces
        self.buses = buses
        self.revisions = revisions
        self._dependents: dict[str, set[Key]] = collections.defaultdict(set)
        self._by_uid: dict[str, Key] = {}

    def get(self, key: Key) -> dict[str, Any] | None:
        """A copy of the stored object (callers change it freely), or None."""
        stored = self._objects._objects.get(key)
        if stored is None or stored.deleted:
            return None
        return copy.deepcopy(stored.last.raw)

    def peek(self, key: Key) -> dict[str, Any] | None:
        """The stored object itself, to read only (no copy: reads are most requests)."""
        stored = self._objects._objects.get(key)
        return None if stored is None or stored.deleted else stored.last.raw

    def items(self, resource: references.resource, namespace: str | None) -> Iterator[dict[str, Any]]:
        for (kind, space, _), stored in list(self._objects._objects.items()):
            if kind == resource and (namespace is None or space == namespace) and not stored.deleted:
                yield stored.last.raw

    def seed(self, key: Key, obj: dict[str, Any]) -> None:
        """Store an object the server starts with (no watcher can be there yet)."""
        obj["metadata"]["resourceVersion"] = str(self.revisions.next())
        self._objects._objects[key] = k8s_dicts.Object(obj)
        self._index(key, obj)

    async def put(self, key: Key, obj: dict[str, Any], event: str) -> dict[str, Any]:
        """Store `obj` under `key` with a new resourceVersion and send `event` (ADDED or MODIFIED)."""
        previous = self.get(key)
        if previous is not None:
            self._unindex(key, previous)
        obj["metadata"]["resourceVersion"] = str(self.revisions.next())
        self._objects._objects[key] = k8s_dicts.Object(obj)
        self._index(key, obj)
        await self.buses[key[0]].publish(event, obj)
        if event == "ADDED":
            await self._adopt(key, obj)
        return obj

    async def _adopt(self, key: Key, obj: dict[str, Any]) -> None:
        """The garbage collector's view of a new object: one whose owners are all gone is deleted, one whose
        owner is being deleted in the foreground is deleted with it (the owner waits for it)."""
        owners = _owner_uids(obj)
        if not owners:
            return
        present = [self.get(self._by_uid[uid]) for uid in owners if uid in self._by_uid]
        if not any(present):
            await self.delete(key, "Background")
        elif any(FOREGROUND in (owner or {}).get("metadata", {}).get("finalizers", ()) for owner in present):
            await self.delete(key, "Foreground")

    def _index(self, key: Key, obj: dict[str, Any]) -> None:
        self._by_uid[str(obj["metadata"]["uid"])] = key
        for uid in _owner_uids(obj):
            self._dependents[uid].add(key)

    def _unindex(self, key: Key, obj: dict[str, Any]) -> None:
        self._by_uid.pop(str(obj["metadata"].get("uid")), None)
        for uid in _owner_uids(obj):
            self._dependents[uid].discard(key)
            if not self._dependents[uid]:
                del self._dependents[uid]

    async def delete(
        self, key: Key, policy: str = "Background", grace_s: int | None = None
    ) -> dict[str, Any] | None:
        """Delete as the API server does (see the module's docstring); the object's last state, or None
        when it is not there. `grace_s`: the request's `gracePeriodSeconds` (pods only)."""
        obj = self.get(key)
        if obj is None:
            return None
        meta = obj["metadata"]
        bound_pod = key[0].plural == "pods" and bool((obj.get("spec") or {}).get("nodeName"))
        if meta.get("deletionTimestamp"):
            if bound_pod and grace_s == 0 and not meta.get("finalizers"):
                await self.remove(key)  # the kubelet's confirmation, or a forced delete
            return self.get(key) or obj
        if bound_pod:
            grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
            grace = int(grace if grace_s is None else grace_s)
            if grace > 0:
                ends = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=grace)
                meta["deletionTimestamp"] = ends.strftime("%Y-%m-%dT%H:%M:%SZ")
                meta["deletionGracePeriodSeconds"] = grace
                return await self.put(key, obj, "MODIFIED")
        uid = str(meta["uid"])
        if policy == "Orphan":
            for dependent in list(self._dependents.get(uid, ())):
                await self._drop_reference(dependent, uid)
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and self._dependents.get(uid):
            finalizers.append(FOREGROUND)
        if finalizers:
            meta["finalizers"] = finalizers
            meta["deletionTimestamp"] = now()
            meta["deletionGracePeriodSeconds"] = 0
            obj = await self.put(key, obj, "MODIFIED")
            if FOREGROUND in finalizers:
                for dependent in list(self._dependents.get(uid, ())):
                    await self.delete(dependent, "Foreground")
                await self._release_foreground(uid)
            return self.get(key) or obj
        await self.remove(key)
        return obj

    def terminating(self, namespace: str | None) -> bool:
        """Whether `namespace` is being deleted (nothing new may be created in it)."""
        obj = self.peek((self._namespaces, None, namespace or ""))
        return obj is not None and bool(obj["metadata"].get("deletionTimestamp"))

    async def delete_namespace(self, key: Key) -> dict[str, Any] | None:
        """Delete a namespace and everything in it (see the module's docstring); its last state."""
        obj = self.get(key)
        if obj is None:
            return None
        if not obj["metadata"].get("deletionTimestamp"):
            obj["metadata"]["deletionTimestamp"] = now()
            obj["status"] = {"phase": "Terminating"}
            obj = await self.put(key, obj, "MODIFIED")
        for content in [k for k in list(self._objects._objects) if k[1] == key[2]]:
            await self.delete(content, "Background")
        await self._namespace_emptied(key[2])
        return self.get(key) or obj

    async def _namespace_emptied(self, namespace: str | None) -> None:
        """Remove a Terminating namespace once nothing is left in it."""
        if not namespace or not self.terminating(namespace):
            return
        if any(k[1] == namespace for k, stored in self._objects._objects.items() if not stored.deleted):
            return
        await self.remove((self._namespaces, None, namespace))

    async def released(self, key: Key, obj: dict[str, Any]) -> bool:
        """After a write: remove an object being deleted whose last finalizer just went (True if so)."""
        meta = obj["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self.remove(key)
            return True
        return False

    async def remove(self, key: Key) -> None:
        """Take the object out of the store, send DELETED, collect what it owned and let a foreground
        deletion waiting for it go on."""
        obj = self.get(key)
        if obj is None:
            return
        self._unindex(key, obj)
        obj["metadata"]["resourceVersion"] = str(self.revisions.next())
        del self._objects._objects[key]
        await self.buses[key[0]].publish("DELETED", obj)
        uid = str(obj["metadata"]["uid"])
        for dependent in list(self._dependents.get(uid, ())):
            await self._drop_reference(dependent, uid, collect=True)
        for owner in _owner_uids(obj):
            await self._release_foreground(owner)
        await self._namespace_emptied(key[1])

    async def _drop_reference(self, key: Key, owner_uid: str, collect: bool = False) -> None:
        """Remove the reference to a gone (or orphaning) owner; with `collect`, delete the object when no
        owner is left (the garbage collector's rule: an object goes with the last of its owners)."""
        obj = self.get(key)
        if obj is None:
            return
        refs = obj["metadata"].get("ownerReferences") or []
        kept = [ref for ref in refs if str(ref.get("uid")) != owner_uid]
        if collect and not kept:
            await self.delete(key, "Background")
            return
        obj["metadata"]["ownerReferences"] = kept
        await self.put(key, obj, "MODIFIED")

    async def _release_foreground(self, owner_uid: str) -> None:
        key = self._by_uid.get(owner_uid)
        owner = self.get(key) if key is not None else None
        if key is None or owner is None or self._dependents.get(owner_uid):
            return
        finalizers = owner["metadata"].get("finalizers") or []
        if FOREGROUND not in finalizers:
            return
        owner["metadata"]["finalizers"] = [f for f in finalizers if f != FOREGROUND]
        if not await self.released(key, owner):
            await self.put(key, owner, "MODIFIED")
