"""Server-side printing: the `meta.k8s.io/v1` Table a real API server answers when a client asks for it
(`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`, as `kubectl get` does), so `kubectl get rjob`
shows the CRD's `additionalPrinterColumns` and `kubectl get pods` a pod's readiness and phase.

Reproduces kube-apiserver's table convertors trimmed to what kubectl prints: a CRD's columns are its
printer columns after Name (`.a.b` JSON paths, with `[?(@.key=="value")]` filters and `[N]` indexes;
`date` columns shown as an age), built-in kinds get
Name and Age, namespaces their Status too, pods Name, Ready, Status, Restarts and Age, events their time,
type, reason, object and message, ConfigMaps and Secrets their Data count (Secrets their Type), Services their
type, address and ports. Each row carries the object's metadata (`includeObject=Metadata`, the
default) or the object itself (`includeObject=Object`).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._local_api_discovery import Kind

_NAME = {"name": "Name", "type": "string", "format": "name", "description": "Name of the object"}
_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
_POD_COLUMNS = (
    {"name": "Ready", "type": "string"},
    {"name": "Status", "type": "string"},
    {"name": "Restarts", "type": "integer"},
    _AGE,
)


def wants_table(accept: str) -> bool:
    """Whether an Accept header asks for a Table (kubectl lists it first and JSON as a fallback)."""
    first = accept.split(",", maxsplit=1)[0]
    return "as=Table" in first


def _age(timestamp: Any) -> str:
    if not isinstance(timestamp, str) or not timestamp:
        return "<unknown>"
    try:
        then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    seconds = int((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


_STEP = re.compile(r"""\.([^.\[]+)|\[\?\(@\.([A-Za-z0-9_]+)\s*==\s*(?:"([^"]*)"|'([^']*)')\)\]|\[(\d+)\]""")
"""One step of a column's JSON path: `.field`, a list filter `[?(@.type=="Ready")]`, or an index `[0]`."""


def _path(obj: Mapping[str, Any], path: str) -> Any:
    """The value at a printer column's JSON path, or None. A filter keeps the first matching item, as
    kube-apiserver's CRD table convertor prints the first result."""
    value: Any = obj
    at = 0
    while at < len(path) and value is not None:
        step = _STEP.match(path, at)
        if step is None:
            return None  # a path beyond this subset prints nothing rather than fail the listing
        field, key, double, single, index = step.groups()
        at = step.end()
        if field is not None:
            value = value.get(field) if isinstance(value, Mapping) else None
        elif key is not None:
            wanted = double if double is not None else single
            items = value if isinstance(value, list) else []
            value = next((i for i in items if isinstance(i, Mapping) and i.get(key) == wanted), None)
        else:
            number = int(index)
            value = value[number] if isinstance(value, list) and number < len(value) else None
    return value


_EVENT_COLUMNS = (
    {"name": "Last Seen", "type": "date", "jsonPath": ".lastTimestamp"},
    {"name": "Type", "type": "string", "jsonPath": ".type"},
    {"name": "Reason", "type": "string", "jsonPath": ".reason"},
    {"name": "Object", "type": "string", "jsonPath": ".involvedObject.name"},
    {"name": "Message", "type": "string", "jsonPath": ".message"},
)


def _count(*fields: str) -> Callable[[Mapping[str, Any]], int]:
    """A cell counting the keys of the object's maps `fields` (a ConfigMap's or Secret's Data column)."""

    def cell(obj: Mapping[str, Any]) -> int:
        return sum(len(obj.get(name) or {}) for name in fields)

    return cell


def _ports(service: Mapping[str, Any]) -> str:
    ports = (service.get("spec") or {}).get("ports") or []
    shown = [f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports if isinstance(p, Mapping)]
    return ",".join(shown) or "<none>"


# Built-in kinds whose columns kube-apiserver computes rather than reads from a path (`cell`).
_COMPUTED: dict[str, tuple[dict[str, Any], ...]] = {
    "ConfigMap": ({"name": "Data", "type": "string", "cell": _count("data", "binaryData")}, _AGE),
    "Secret": (
        {"name": "Type", "type": "string", "jsonPath": ".type"},
        {"name": "Data", "type": "string", "cell": _count("data")},
        _AGE,
    ),
    "Service": (
        {
            "name": "Type",
            "type": "string",
            "cell": lambda o: (o.get("spec") or {}).get("type") or "ClusterIP",
        },
        {
            "name": "Cluster-IP",
            "type": "string",
            "cell": lambda o: (o.get("spec") or {}).get("clusterIP") or "<none>",
        },
        {"name": "External-IP", "type": "string", "cell": lambda o: "<none>"},
        {"name": "Port(s)", "type": "string", "cell": _ports},
        _AGE,
    ),
}


def _columns(kind: Kind) -> tuple[dict[str, Any], ...]:
    if kind.printer_columns:
        return tuple(kind.printer_columns)
    if kind.kind == "Pod":
        return _POD_COLUMNS
    if kind.kind == "Event":
        return _EVENT_COLUMNS
    if kind.kind == "Namespace":
        return ({"name": "Status", "type": "string", "jsonPath": ".status.phase"}, _AGE)
    return _COMPUTED.get(kind.kind, (_AGE,))


def _pod_cells(pod: Mapping[str, Any]) -> list[Any]:
    status = pod.get("status") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    statuses = status.get("containerStatuses") or []
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    return [f"{len(containers) if ready else 0}/{len(containers)}", _pod_status(pod), restarts]


def _pod_status(pod: Mapping[str, Any]) -> str:
    """The STATUS kube-apiserver prints: the phase, or the pod's reason, or the last container's waiting or
    terminated reason (`Completed`, `Error`, `CrashLoopBackOff`), `Terminating` once it is being deleted."""
    status = pod.get("status") or {}
    shown = status.get("reason") or status.get("phase") or "Pending"
    for container in reversed(status.get("containerStatuses") or []):  # the first container's state wins
        state = container.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        if waiting.get("reason"):
            shown = waiting["reason"]
        elif terminated:
            code, signal = terminated.get("exitCode", 0), terminated.get("signal", 0)
            shown = terminated.get("reason") or (f"Signal:{signal}" if signal else f"ExitCode:{code}")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        shown = "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    return str(shown)


def _cells(kind: Kind, obj: Mapping[str, Any]) -> list[Any]:
    cells: list[Any] = [(obj.get("metadata") or {}).get("name", "")]
    if kind.kind == "Pod" and not kind.printer_columns:
        cells.extend(_pod_cells(obj))
        return [*cells, _age(_path(obj, ".metadata.creationTimestamp"))]
    for column in _columns(kind):
        if "cell" in column:
            cells.append(column["cell"](obj))
            continue
        value = _path(obj, column["jsonPath"])
        cells.append(_age(value) if column.get("type") == "date" else value)
    return cells


def _row(kind: Kind, obj: Mapping[str, Any], include: str) -> dict[str, Any]:
    if include == "Object":
        embedded: Any = obj
    elif include == "None":
        embedded = None
    else:
        embedded = {
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": obj.get("metadata") or {},
        }
    return {"cells": _cells(kind, obj), "object": embedded}


def table(
    kind: Kind, objects: Sequence[Mapping[str, Any]], resource_version: str, include: str = "Metadata"
) -> dict[str, Any]:
    definitions = [_NAME]
    for column in _columns(kind):
        definition = {key: column[key] for key in ("name", "type", "description") if key in column}
        definitions.append(
            {"format": "", "description": "", "priority": column.get("priority", 0)} | definition
        )
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [{"priority": 0, **d} for d in definitions],
        "rows": [_row(kind, obj, include) for obj in objects],
    }
