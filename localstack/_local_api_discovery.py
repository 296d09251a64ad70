"""What the local API server serves and how it describes it to clients: the resource kinds (built-in ones and
those of registered CustomResourceDefinitions), the discovery documents (`/api/v1`, `/apis/G/V`) and the
OpenAPI documents (`/openapi/v2`, `/openapi/v3`) that kubectl reads before it applies anything.

Each piece reproduces what kube-apiserver sends, trimmed to what clients use:
- an APIResourceList lists a subresource (`resilientjobs/status`) without short names or categories, so a
  short name (`rjob`) resolves to the resource only (kmock copies them onto every subresource);
- the OpenAPI v3 document of a group/version has, per kind, a schema carrying
  `x-kubernetes-group-version-kind` and paths whose operations declare the `fieldValidation` parameter:
  kubectl (`QueryParamVerifierV3`) then leaves validation to the server (`?fieldValidation=Strict`), as with
  a real server since Kubernetes 1.27, instead of downloading the OpenAPI v2 document;
- the OpenAPI v2 document (JSON) has the same definitions, for clients that still read it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

# The schema of a kind the local server does not validate (built-in kinds: the operator and kopf write
# them, and a real server's schema for them would be thousands of lines).
OPEN_SCHEMA: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
VERBS = ("list", "watch", "get", "create", "patch", "update", "delete")


@dataclass(frozen=True, slots=True)
class Kind:
    """One served resource: where it lives, what it is called and (for a CRD's kind) its schema."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()
    printer_columns: tuple[dict[str, Any], ...] = ()
    schema: dict[str, Any] = field(default_factory=lambda: OPEN_SCHEMA)
    """The structural OpenAPI v3 schema of the whole object (a CRD's `openAPIV3Schema`)."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def qualified(self) -> str:
        """`resilientjobs.resilientjob.io`, `pods`: how the API server names the resource in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def prefix(self, namespace: str | None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if namespace and self.namespaced:
            return f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{base}/{self.plural}"


def kinds_of_crd(crd: dict[str, Any]) -> list[Kind]:
    """The kinds a CustomResourceDefinition serves (one per served version)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    found = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        found.append(
            Kind(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=tuple(sorted((version.get("subresources") or {}).keys())),
                printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
                schema=(version.get("schema") or {}).get("openAPIV3Schema") or OPEN_SCHEMA,
            )
        )
    return found


def resource_list(kinds: list[Kind], group: str, version: str) -> dict[str, Any]:
    """The APIResourceList of one group/version (`GET /apis/G/V`, `GET /api/v1`)."""
    resources = []
    for kind in kinds:
        if (kind.group, kind.version) != (group, version):
            continue
        resources.append(
            {
                "name": kind.plural,
                "singularName": kind.singular,
                "namespaced": kind.namespaced,
                "kind": kind.kind,
                "verbs": list(VERBS),
                "shortNames": list(kind.short_names),
                "categories": list(kind.categories),
            }
        )
        for subresource in kind.subresources:
            resources.append(
                {
                    "name": f"{kind.plural}/{subresource}",
                    "singularName": "",
                    "namespaced": kind.namespaced,
                    "kind": kind.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        if kind.kind == "Pod":
            resources.append(
                {"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod", "verbs": ["get"]}
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


def _definition_name(kind: Kind) -> str:
    # As kube-apiserver names CRD definitions: the reversed group, then version and kind.
    reversed_group = ".".join(reversed(kind.group.split("."))) if kind.group else "io.k8s.api.core"
    return f"{reversed_group}.{kind.version}.{kind.kind}"


def _gvk(kind: Kind) -> list[dict[str, str]]:
    return [{"group": kind.group, "version": kind.version, "kind": kind.kind}]


def _operations(kind: Kind, ref: str, v3: bool) -> dict[str, Any]:
    """The path items of a kind: enough for kubectl to see which kind a PATCH serves and that it takes
    `fieldValidation`."""
    param: dict[str, Any] = {"name": "fieldValidation", "in": "query"}
    param.update({"schema": {"type": "string"}} if v3 else {"type": "string"})
    body: dict[str, Any] = {"requestBody": {"content": {"application/json": {"schema": {"$ref": ref}}}}}
    v2_parameters = [param, {"name": "body", "in": "body", "schema": {"$ref": ref}}]

    def operation(verb: str, action: str, params: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "operationId": f"{verb}{kind.kind}",
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": _gvk(kind)[0],
            "parameters": params,
            "responses": {"200": {"description": "OK"}},
            **(body if verb in ("create", "replace", "patch") and v3 else {}),
        }

    write = [param] if v3 else v2_parameters
    namespace = "/namespaces/{namespace}" if kind.namespaced else ""
    base = f"/apis/{kind.group}/{kind.version}" if kind.group else f"/api/{kind.version}"
    return {
        f"{base}{namespace}/{kind.plural}": {
            "get": operation("list", "list", []),
            "post": operation("create", "post", write),
        },
        f"{base}{namespace}/{kind.plural}/{{name}}": {
            "get": operation("read", "get", []),
            "put": operation("replace", "put", write),
            "patch": operation("patch", "patch", write),
            "delete": operation("delete", "delete", []),
        },
    }


def _with_gvk(kind: Kind) -> dict[str, Any]:
    return {**kind.schema, "x-kubernetes-group-version-kind": _gvk(kind)}


def openapi_v3_root(kinds: list[Kind]) -> dict[str, Any]:
    """`GET /openapi/v3`: one entry per group/version, each with the URL of its document (the hash in the
    URL changes with the document, as kube-apiserver's does, so clients' caches stay right)."""
    paths = {}
    for group, version in sorted({(kind.group, kind.version) for kind in kinds}):
        key = f"apis/{group}/{version}" if group else f"api/{version}"
        digest = hashlib.sha256(
            json.dumps(openapi_v3_document(kinds, group, version), sort_keys=True).encode()
        ).hexdigest()[:16]
        paths[key] = {"serverRelativeURL": f"/openapi/v3/{key}?hash={digest}"}
    return {"paths": paths}


def openapi_v3_document(kinds: list[Kind], group: str, version: str) -> dict[str, Any]:
    """`GET /openapi/v3/apis/G/V`: the OpenAPI 3.0 document of one group/version."""
    served = [kind for kind in kinds if (kind.group, kind.version) == (group, version)]
    paths: dict[str, Any] = {}
    for kind in served:
        paths.update(_operations(kind, f"#/components/schemas/{_definition_name(kind)}", v3=True))
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": paths,
        "components": {"schemas": {_definition_name(kind): _with_gvk(kind) for kind in served}},
    }


def openapi_v2(kinds: list[Kind]) -> dict[str, Any]:
    """`GET /openapi/v2` (JSON): every kind's definition and paths, as one Swagger 2.0 document."""
    paths: dict[str, Any] = {}
    for kind in kinds:
        paths.update(_operations(kind, f"#/definitions/{_definition_name(kind)}", v3=False))
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": paths,
        "definitions": {_definition_name(kind): _with_gvk(kind) for kind in kinds},
    }
