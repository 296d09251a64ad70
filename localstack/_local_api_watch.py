"""Resource versions and the watch cache of the local API server, as kube-apiserver keeps them.

Every change gets the next number of one counter (etcd's revision) as its `resourceVersion`. Each resource
keeps a bounded history of its recent events, so a watch started at a resourceVersion (as kopf and
`kubectl get -w` start theirs, from a list's version) is sent exactly the changes after it. A version older
than the history is answered with `410 Gone` (reason Expired), as a real server answers once etcd has
compacted past it; `expire()` forces that (and ends every open watch with the same error), so tests can see
that the operator copes: on 410 a client lists again and watches from the new version.
"""

from __future__ import annotations

import collections
import copy
import itertools
from typing import Any

import attrs
from kmock._internal import aiobus

HISTORY = 2048
"""Events kept per resource (kube-apiserver's watch cache keeps a window of the same kind)."""


class Revisions:
    """The server-wide change counter."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self.current = 0

    def next(self) -> int:
        self.current = next(self._counter)
        return self.current


class WatchExpired(Exception):
    """Put into a bus to end its open watches with 410 Gone."""


def expired_event(version: str, current: int) -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {version} ({current})",
            "reason": "Expired",
            "code": 410,
        },
    }


@attrs.mutable(weakref_slot=True, kw_only=True)
class RecordingBus(aiobus.Bus[Any]):
    """kmock's event bus of one resource, plus the watch-cache history of its events."""

    revisions: Revisions
    history: collections.deque[tuple[int, dict[str, Any]]] = attrs.field(
        factory=lambda: collections.deque(maxlen=HISTORY)
    )
    oldest: int = 0
    """Events at or before this version are no longer in the history."""

    async def publish(self, event_type: str, obj: dict[str, Any]) -> None:
        """Send an event; `obj` already carries its new resourceVersion. A copy is sent and kept, so that
        later changes to the stored object never show in an event already sent."""
        event = {"type": event_type, "object": copy.deepcopy(obj)}
        version = int(obj["metadata"]["resourceVersion"])
        if len(self.history) == self.history.maxlen:
            self.oldest = self.history[0][0]
        self.history.append((version, event))
        await self.put(event)

    def since(self, version: int) -> list[dict[str, Any]] | None:
        """The events after `version`, or None when they are no longer all known (410)."""
        if version < self.oldest:
            return None
        return [event for seen, event in self.history if seen > version]

    async def expire(self) -> None:
        self.oldest = self.revisions.current
        self.history.clear()
        await self.put(WatchExpired())
