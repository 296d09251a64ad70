"""Admission in the local API server: what kube-apiserver does to an object between reading the request
and storing it. A new object gets the fields the server owns (uid, creationTimestamp, generation, namespace,
a name from generateName); names and label values are checked (`operator.names`); a custom resource is
defaulted, pruned and validated against its CRD (`_local_api_schema`), a ConfigMap or Secret decoded as Go
would; a write keeps the identity fields and, with a status subresource, changes only its own part of the
object. Every refusal is the Status a real server sends (422 Invalid naming the fields, 400 BadRequest,
415)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from typing import Any

import yaml
from kmock._internal import rendering
from kmock._internal.k8s import KubernetesError

from resilientjob.operator import names as _names

from . import _local_api_protobuf as protobuf
from . import _local_api_schema as schema
from ._local_api_discovery import OPEN_SCHEMA, Kind
from ._local_api_store import now


def refuse(code: int, reason: str, message: str, **details: Any) -> KubernetesError:
    """An API error with the Status body a real server sends."""
    return KubernetesError(status=code, reason=reason, message=message, details=details or {})


WITHOUT_GENERATION = frozenset({"ConfigMap", "Secret", "Namespace", "Service", "ServiceAccount", "Event"})
"""Kinds a real API server keeps no `metadata.generation` for (they have no spec to count changes of)."""


def stamp(kind: Kind, obj: dict[str, Any], namespace: str | None) -> dict[str, Any]:
    """A new object's server-owned fields, as the API server sets them on create."""
    obj = {**obj, "kind": kind.kind, "apiVersion": kind.api_version}
    meta = obj["metadata"] = dict(obj.get("metadata") or {})
    if not meta.get("name") and meta.get("generateName"):
        meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
    if kind.namespaced:
        meta["namespace"] = namespace or meta.get("namespace") or "default"
    meta["uid"] = str(uuid.uuid4())
    meta["creationTimestamp"] = now()
    meta.pop("generation", None)
    if kind.kind not in WITHOUT_GENERATION:
        meta["generation"] = 1
    meta["resourceVersion"] = "0"
    if kind.kind == "Secret":
        obj.setdefault("type", "Opaque")
    if kind.kind == "Pod":
        # A pod is Pending from the moment it exists, before any kubelet has seen it; what a client sent as
        # status is not kept (clients that list pods right after creating them read `status.phase`).
        obj["status"] = {"phase": "Pending", "qosClass": qos_class(obj.get("spec") or {})}
    for server_only in ("deletionTimestamp", "deletionGracePeriodSeconds"):
        meta.pop(server_only, None)
    return obj


def qos_class(spec: Mapping[str, Any]) -> str:
    """A pod's quality-of-service class, from its containers' cpu and memory requests and limits: Guaranteed
    when every container limits both and requests what it limits (a request left out is its limit),
    BestEffort when none sets either, Burstable otherwise."""
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    guaranteed, best_effort = True, True
    for container in containers:
        resources = container.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for resource in ("cpu", "memory"):
            limit, request = limits.get(resource), requests.get(resource, limits.get(resource))
            best_effort = best_effort and limit is None and request is None
            guaranteed = guaranteed and limit is not None and str(request) == str(limit)
    if best_effort:
        return "BestEffort"
    return "Guaranteed" if guaranteed and containers else "Burstable"


def invalid(kind: Kind, name: str, errors: list[str]) -> KubernetesError:
    joined = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
    causes = [{"field": e.split(":", 1)[0], "message": e.split(": ", 1)[-1]} for e in errors]
    group = f".{kind.group}" if kind.group else ""
    return refuse(
        422,
        "Invalid",
        f'{kind.kind}{group} "{name}" is invalid: {joined}',
        name=name,
        group=kind.group,
        kind=kind.kind,
        causes=causes,
    )


def admit(
    params: Mapping[str, str], kind: Kind, obj: dict[str, Any], old: dict[str, Any] | None
) -> tuple[dict[str, Any], list[str]]:
    """Validate a new state of an object; the state to store and the warnings to send."""
    name = obj["metadata"].get("name", "")
    outcome = None if kind.schema is OPEN_SCHEMA else schema.admit(obj, kind.schema, old)
    unknown = [f'unknown field "{field}"' for field in (outcome.unknown if outcome else [])]
    directive = params.get("fieldValidation", "")
    if unknown and directive == "Strict":
        # The server's strict decoding refuses the body before any validation runs: a misspelt required
        # field is named as unknown, not only reported as missing.
        raise refuse(
            400,
            "BadRequest",
            f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
            f"strict decoding error: {', '.join(unknown)}",
        )
    errors = []
    if old is None:
        check = (
            _names.dns1035_errors
            if kind.kind == "Service"
            else (_names.label_errors if kind.kind == "Namespace" else _names.subdomain_errors)
        )
        errors = [f'metadata.name: Invalid value: "{name}": {e}' for e in check(name)]
        if not name:
            errors = ["metadata.name: Required value: name or generateName is required"]
    for value in (obj["metadata"].get("labels") or {}).values():
        errors += [
            f'metadata.labels: Invalid value: "{value}": {e}' for e in _names.label_value_errors(str(value))
        ]
    if errors:
        raise invalid(kind, name, errors)
    if outcome is None:
        decoding = schema.decoding_error(kind.kind, obj)
        if decoding:
            raise refuse(400, "BadRequest", decoding)
        return _folded(kind, obj), []
    if outcome.errors:
        raise invalid(kind, name, outcome.errors)
    return _folded(kind, outcome.obj), unknown if directive != "Ignore" else []


def _folded(kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
    """A Secret's `stringData` written into its `data` (base64), as the API server does on every write:
    `stringData` is write-only, and a reader (the operator's Redis password) finds every key in `data`."""
    if kind.kind != "Secret" or not isinstance(obj.get("stringData"), dict):
        return obj
    obj = dict(obj)
    strings = obj.pop("stringData")
    encoded = {key: base64.b64encode(str(value).encode()).decode() for key, value in strings.items()}
    obj["data"] = {**(obj.get("data") or {}), **encoded}
    return obj


def body(request: rendering.Request) -> Any:
    if "protobuf" in request.headers.get("Content-Type", ""):
        # kubectl's typed commands (`create namespace`, `create secret`) send protobuf; `apply` sends JSON.
        try:
            return protobuf.decode(request.body)
        except protobuf.ProtobufError as exc:
            message = f"{exc}: send it as JSON (`kubectl apply -f`)"
            raise refuse(415, "UnsupportedMediaType", message) from None
    data = request.data
    if data is None and request.text:
        try:
            data = yaml.safe_load(request.text)
        except yaml.YAMLError as exc:
            raise refuse(
                400, "BadRequest", f"the body of the request was in an unknown format: {exc}"
            ) from None
    return data


def owned_parts(
    kind: Kind, subresource: str | None, old: dict[str, Any], new: dict[str, Any]
) -> dict[str, Any]:
    """What a write may change: the server keeps the identity fields, and with a status subresource a
    write to the object leaves its status alone while one to `/status` changes nothing else (a pod's
    status is kept as kmock kept it: writable both ways, as the process kubelet writes it)."""
    meta = new.setdefault("metadata", {})
    for field in (
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "generation",
        "resourceVersion",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ):
        if field in old["metadata"]:
            meta[field] = old["metadata"][field]
        else:
            meta.pop(field, None)
    new["kind"], new["apiVersion"] = kind.kind, kind.api_version
    if "status" in kind.subresources and kind.kind != "Pod":
        if subresource == "status":
            return (
                {**old, "status": new.get("status")}
                if new.get("status") is not None
                else {k: v for k, v in old.items() if k != "status"}
            )
        if "status" in old:
            new["status"] = old["status"]
        else:
            new.pop("status", None)
    return new
