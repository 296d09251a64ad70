"""The local Kubernetes API: kmock's KubernetesEmulator (its HTTP server, request parsing, objects array and
event buses) answering as kube-apiserver does, for the operator, for `rjob local` and for the real kubectl.
Used by the tests and by `rjob local`; in a real cluster the API server does all of this.

What kmock leaves out and this adds, each reproducing the real server's behaviour:
- metadata the server owns (uid, resourceVersion, creationTimestamp, generation, namespace, generateName),
  `kind`/`apiVersion` on every object and list, names checked as the server checks them (422);
- only registered resources are served (a CRD created through the API registers its kinds); anything else
  is 404, as an unknown apiVersion is on a real server;
- custom resources defaulted, pruned and validated against their CRD's schema and CEL rules
  (`_local_api_schema`, 422 naming the field; 400 for unknown fields with `fieldValidation=Strict`);
- writes: JSON merge patch (strategic merge patch taken as merge), JSON patch, server-side apply (create or
  merge, without field ownership), replace; a `metadata.resourceVersion` that is not the current one is a
  409 conflict; the status subresource and the main resource each change their own part of the object;
- a pod naming a ServiceAccount its namespace lacks is refused (403), as the ServiceAccount admission
  plugin refuses it;
- deletion with finalizers, propagation policies and owner-reference garbage collection
  (`_local_api_store`); watches from a resourceVersion with 410 Gone once it is too old
  (`_local_api_watch`); label and field selectors (`_local_api_select`);
- protobuf bodies of the kinds kubectl's typed commands create (`create namespace/secret/configmap`;
  `_local_api_protobuf`), which kmock would try to read as text;
- discovery, OpenAPI v2/v3 documents (`_local_api_discovery`) and server-side printing to Tables
  (`_local_api_tables`) for kubectl, and `pods/NAME/log` from the process kubelet's output files;
- optionally, bearer-token authentication with a token that can rotate (401 with a stale one).

kmock records every request and routes each one by filtering that record, and answers by scanning every
stored object (creating N pods cost O(N^2): 1,024 pods took 437 s); here a request is forgotten once answered
and objects are looked up by key, so thousands of pods stay fast.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import json
import time
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import dicts, enums, parsing, references, rendering
from kmock._internal.k8s import KubernetesError

from . import _local_api_admission as admission
from . import _local_api_discovery as discovery
from . import _local_api_logs as logs
from . import _local_api_select as select
from . import _local_api_tables as tables
from ._local_api_admission import refuse
from ._local_api_discovery import Kind
from ._local_api_store import Key, Store
from ._local_api_watch import RecordingBus, Revisions, WatchExpired, expired_event
from .kubelet import pod_directory

# (group, version, plural, kind, namespaced)
CORE_RESOURCES: tuple[tuple[str, str, str, str, bool], ...] = (
    ("", "v1", "pods", "Pod", True),
    ("", "v1", "events", "Event", True),
    ("", "v1", "configmaps", "ConfigMap", True),
    ("", "v1", "secrets", "Secret", True),
    ("", "v1", "services", "Service", True),
    ("", "v1", "serviceaccounts", "ServiceAccount", True),
    ("", "v1", "namespaces", "Namespace", False),
    # kopf watches CRDs to learn when resources appear; without it, it never starts watching.
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False),
    ("kopf.dev", "v1", "kopfpeerings", "KopfPeering", True),
    ("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", False),
)
_CRDS = "customresourcedefinitions"
UNDELETABLE_NAMESPACES = frozenset({"default", "kube-system", "kube-public"})
"""The namespaces a real API server's NamespaceLifecycle admission refuses to delete."""
_SHORT_NAMES = {
    "pods": ("po",),
    "configmaps": ("cm",),
    "services": ("svc",),
    "serviceaccounts": ("sa",),
    "namespaces": ("ns",),
    "events": ("ev",),
    _CRDS: ("crd", "crds"),
}


@attrs.define(kw_only=True)
class LocalApiServer(kmock.KubernetesEmulator):
    """kmock's emulator serving as kube-apiserver (see the module's docstring)."""

    pod_logs: Path | None = None
    """Where the process kubelet keeps pods' files (`kubelet.pod_directory`): their output is served as
    `pods/NAME/log`."""

    token_file: Path | None = None
    """When set, every request must carry `Authorization: Bearer <the file's content>` (401 otherwise), read
    at each request: rewriting the file rotates the credentials, as a service-account token rotates."""

    _revisions: Revisions = attrs.field(factory=Revisions, init=False)
    _kinds: dict[tuple[str, str, str], Kind] = attrs.field(factory=dict, init=False)
    _store: Store = attrs.field(default=None, init=False)
    _watch_buses: collections.defaultdict[references.resource, RecordingBus] = attrs.field(
        default=None, init=False
    )
    _namespaces: references.resource = attrs.field(
        factory=lambda: references.resource("", "v1", "namespaces"), init=False
    )
    _closing: bool = attrs.field(default=False, init=False)
    """Set by `close_streams`: log follows end, and watches are not held open by clients that never leave."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._watch_buses = collections.defaultdict(lambda: RecordingBus(revisions=self._revisions))
        self._buses = self._watch_buses  # type: ignore[assignment]  # kmock's field, the same buses
        self._store = Store(self._objects, self._watch_buses, self._revisions, self._namespaces)
        for group, version, plural, kind, namespaced in CORE_RESOURCES:
            subresources = ("status",) if kind == "Pod" else ()
            # `kubectl get all` lists the kinds of the `all` category (pods and services, as a real server).
            categories = ("all",) if plural in ("pods", "services") else ()
            self._register(
                Kind(
                    group,
                    version,
                    plural,
                    kind,
                    namespaced,
                    _SHORT_NAMES.get(plural, ()),
                    categories,
                    subresources,
                )
            )
        from resilientjob.operator.crd import crd_manifest

        crd = crd_manifest()
        for served in discovery.kinds_of_crd(crd):
            self._register(served)
        # The namespaces a new cluster has; an object of any other namespace is refused until it is created.
        namespace_kind = self._kinds["", "v1", "namespaces"]
        for namespace in ("default", "kube-system", "kube-public", "kube-node-lease"):
            body = admission.stamp(namespace_kind, {"metadata": {"name": namespace}}, None)
            body["status"] = {"phase": "Active"}
            self._store.seed((self._namespaces, None, namespace), body)
        crd_kind = self._kinds["apiextensions.k8s.io", "v1", _CRDS]
        stored = admission.stamp(crd_kind, crd, None)
        stored["status"] = {"conditions": [{"type": "Established", "status": "True"}]}
        self._store.seed(
            (references.resource(crd_kind.group, "v1", _CRDS), None, crd["metadata"]["name"]), stored
        )

    # ---- the kinds served ---------------------------------------------------------------------------
    def _register(self, kind: Kind) -> None:
        self._kinds[kind.group, kind.version, kind.plural] = kind
        # kmock's own discovery (`/apis`, `/apis/GROUP`) lists what its `resources` hold.
        self.resources[
            f"{kind.group}/{kind.version}/{kind.plural}" if kind.group else f"v1/{kind.plural}"
        ] = kmock.ResourceInfo(
            kind=kind.kind, singular=kind.singular, namespaced=kind.namespaced, verbs=set(discovery.VERBS)
        )

    def _admit_service_account(self, pod: dict[str, Any]) -> None:
        """The ServiceAccount admission plugin: a pod names an account of its namespace that exists (every
        namespace has `default`, which the emulator does not store)."""
        account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
        space, name = pod["metadata"].get("namespace"), pod["metadata"].get("name", "")
        accounts = references.resource("", "v1", "serviceaccounts")
        if account != "default" and self._store.peek((accounts, space, account)) is None:
            raise refuse(
                403,
                "Forbidden",
                f'pods "{name}" is forbidden: error looking up service account {space}/{account}: '
                f'serviceaccount "{account}" not found',
                name=name,
                kind="pods",
            )

    def kind_of(self, resource: references.resource) -> Kind:
        kind = self._kinds.get((resource.group or "", resource.version or "", resource.plural or ""))
        if kind is None:
            raise refuse(404, "NotFound", "the server could not find the requested resource")
        return kind

    # ---- routing ------------------------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock reads `namespaces` in a path as the start of `namespaces/NS/...`, so it cannot parse the
        paths of the namespaces resource itself (`/api/v1/namespaces[/NAME[/status]]`), and it decodes
        every body as UTF-8 text, which a protobuf body is not: those requests are parsed here, everything
        else by kmock."""
        parts = raw_request.path.strip("/").split("/")
        namespaces = parts[:3] == ["api", "v1", "namespaces"] and (
            len(parts) <= 4 or parts[4] in ("status", "finalize")
        )
        if not namespaces and "protobuf" not in raw_request.headers.get("Content-Type", ""):
            return await super().__call__(raw_request)
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        if namespaces:
            name = parts[3] if len(parts) > 3 else None
            path = parsing.ParsedPath(group="", version="v1", plural="namespaces", name=name)
            subresource = parts[4] if len(parts) > 4 else None
        else:
            path = parsing.parse_path(raw_request.path)
            name, subresource = path.name, path.subresource
        request = rendering.Request(
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            data=data,
            body=body,
            text=body.decode(errors="replace"),
            action=parsing.guess_k8s(path, enums.method(raw_request.method), dict(raw_request.query)),
            resource=self._namespaces if namespaces else _resource(path),
            namespace=None if namespaces else path.namespace,
            name=name,
            subresource=subresource,
        )
        self._requests.append(request)
        response: aiohttp.web.StreamResponse = await self._handle(request)
        return response

    async def _handle(self, request: rendering.Request) -> Any:
        try:
            self._authenticate(request)
            return await self._route(request)
        except KubernetesError as exc:
            # Answered here: kmock would also keep the error and raise it when the server stops.
            return await self._render_error(exc)
        finally:
            self._forget(request)

    def _authenticate(self, request: rendering.Request) -> None:
        if self.token_file is None:
            return
        expected = f"Bearer {self.token_file.read_text().strip()}"
        if request.headers.get("Authorization", "") != expected:
            raise refuse(401, "Unauthorized", "Unauthorized")

    async def _route(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/")
        kinds = list(self._kinds.values())
        if path == "/openapi/v2":
            return aiohttp.web.json_response(discovery.openapi_v2(kinds))
        if path == "/openapi/v3":
            return aiohttp.web.json_response(discovery.openapi_v3_root(kinds))
        if path.startswith("/openapi/v3/"):
            parts = path.removeprefix("/openapi/v3/").split("/")
            group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
            if not any((k.group, k.version) == (group, version) for k in kinds):
                raise refuse(404, "NotFound", "the server could not find the requested resource")
            return aiohttp.web.json_response(discovery.openapi_v3_document(kinds, group, version))
        resource = request.resource
        if resource is None or not resource.version:
            return await super()._handle(request)  # /, /version, /api, /apis, /apis/GROUP: kmock's
        if not resource.plural:
            if not any((k.group, k.version) == (resource.group, resource.version) for k in kinds):
                raise refuse(404, "NotFound", "the server could not find the requested resource")
            return aiohttp.web.json_response(
                discovery.resource_list(kinds, resource.group or "", resource.version)
            )
        kind = self.kind_of(resource)
        key: Key = (resource, request.namespace if kind.namespaced else None, request.name or "")
        method = request.method.value.upper()
        if request.subresource == "log" and kind.kind == "Pod" and method == "GET":
            return await self._log(request, key)
        if request.subresource is not None and request.subresource not in kind.subresources:
            raise refuse(404, "NotFound", "the server could not find the requested resource")
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, kind, key)
        if method == "GET":
            return self._read(request, kind, key)
        if method == "POST" and not request.name:
            return await self._create(request, kind)
        if method in ("PATCH", "PUT") and request.name:
            return await self._update(request, kind, key)
        if method == "DELETE" and request.name:
            return await self._delete(request, kind, key)
        raise refuse(405, "MethodNotAllowed", f"{method} is not supported on {kind.qualified}")

    # ---- reads --------------------------------------------------------------------------------------
    def _read(self, request: rendering.Request, kind: Kind, key: Key) -> aiohttp.web.Response:
        version = str(self._revisions.current)
        accept = request.headers.get("Accept", "")
        include = request.params.get("includeObject", "Metadata")
        if request.name:
            obj = self._existing(kind, key)
            if tables.wants_table(accept):
                return aiohttp.web.json_response(tables.table(kind, [obj], version, include))
            return aiohttp.web.json_response(obj)
        wanted = select.of_request(request.params)
        items = [self._stamp_kind(kind, o) for o in self._store.items(key[0], key[1]) if wanted(o)]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        if tables.wants_table(accept):
            return aiohttp.web.json_response(tables.table(kind, items, version, include))
        body = {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": version},
            "items": items,
        }
        return aiohttp.web.json_response(body)

    def _existing(self, kind: Kind, key: Key) -> dict[str, Any]:
        obj = self._store.peek(key)
        if obj is None:
            raise refuse(
                404,
                "NotFound",
                f'{kind.qualified} "{key[2]}" not found',
                name=key[2],
                group=kind.group,
                kind=kind.plural,
            )
        return self._stamp_kind(kind, obj)

    @staticmethod
    def _stamp_kind(kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
        if obj.get("kind") != kind.kind or obj.get("apiVersion") != kind.api_version:
            obj = {**obj, "kind": kind.kind, "apiVersion": kind.api_version}
        return obj

    async def _log(self, request: rendering.Request, key: Key) -> aiohttp.web.StreamResponse:
        """`GET pods/NAME/log`: what the process kubelet captured of the pod's process, with kubectl's
        options (`_local_api_logs`)."""
        pod = self._existing(self.kind_of(key[0]), key)
        if request.params.get("previous") in ("true", "1"):
            # The process kubelet restarts no container in place: there is never a previous one.
            containers = ((pod or {}).get("spec") or {}).get("containers") or [{}]
            container = request.params.get("container") or containers[0].get("name", "")
            raise refuse(
                400, "BadRequest", f'previous terminated container "{container}" in pod "{key[2]}" not found'
            )
        options = logs.LogOptions.of(request.params, time.time())
        path = None if self.pod_logs is None else pod_directory(self.pod_logs, key[1] or "", key[2]) / "log"
        lines, offset = logs.read_lines(path) if path is not None else ([], 0)
        body = logs.render(lines, options)
        if not options.follow or path is None:
            return aiohttp.web.Response(body=body, content_type="text/plain")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        assert request._raw_request is not None
        await response.prepare(request._raw_request)
        await response.write(body)

        def ended() -> bool:
            pod = self._store.get(key)
            done = pod is None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            return done or self._closing

        left = None if options.limit_bytes is None else options.limit_bytes - len(body)
        await logs.follow(path, offset, options, response.write, ended, left)
        await response.write_eof()
        return response

    async def _watch(self, request: rendering.Request, kind: Kind, key: Key) -> aiohttp.web.StreamResponse:
        """A watch stream: from `resourceVersion` (the events after it, or 410 when they are no longer
        known), or, without one, every current object as ADDED first; ends after `timeoutSeconds`."""
        bus = self._watch_buses[key[0]]
        params = dict(request.params)
        if request.name:  # a watch of one object (`.../pods/NAME?watch=true`, kubectl's wait for deletion)
            params["fieldSelector"] = ",".join(
                filter(None, [params.get("fieldSelector"), f"metadata.name={request.name}"])
            )
        wanted = select.of_request(params)
        as_table = tables.wants_table(request.headers.get("Accept", ""))
        since = request.params.get("resourceVersion", "")
        marker = await bus.mark()
        backlog: list[dict[str, Any]] | None
        if since.isdigit() and since != "0":
            backlog = bus.since(int(since))
        else:
            backlog = [{"type": "ADDED", "object": o} for o in self._store.items(key[0], key[1])]
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        assert request._raw_request is not None
        await response.prepare(request._raw_request)

        async def send(event: dict[str, Any]) -> None:
            obj = self._stamp_kind(kind, event["object"]) if event["type"] != "ERROR" else event["object"]
            if event["type"] != "ERROR":
                if (key[1] is not None and obj["metadata"].get("namespace") != key[1]) or not wanted(obj):
                    return
                if as_table:
                    obj = tables.table(kind, [obj], obj["metadata"]["resourceVersion"])
            await response.write(json.dumps({"type": event["type"], "object": obj}).encode() + b"\n")

        try:
            if backlog is None:
                await send(expired_event(since, self._revisions.current))
                return response
            for event in backlog:
                await send(event)
            # A server on its way down answers what it has and holds no watch open (`close_streams`).
            timeout = 0.0 if self._closing else float(request.params.get("timeoutSeconds") or 1800)
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(timeout):
                    async for event in bus.stream(since=marker):
                        await send(event)
        except WatchExpired:
            with contextlib.suppress(ConnectionError):
                await send(expired_event(since or "0", self._revisions.current))
        finally:
            await bus.unmark(marker)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    async def close_streams(self) -> None:
        """Before the server stops: end every open watch and log follow (a `kubectl get -w` never leaves by
        itself, and the server's shutdown waited for it: `rjob local down` gave up while the stack ran on)."""
        self._closing = True
        await self.expire_watches()

    async def expire_watches(self) -> None:
        """Behave as after an etcd compaction: end every open watch with 410 Gone and forget the history,
        so that clients must list again (kopf and kubectl do)."""
        for bus in list(self._watch_buses.values()):
            await bus.expire()

    # ---- writes -------------------------------------------------------------------------------------
    def _answer(self, obj: dict[str, Any], status: int, warnings: list[str]) -> aiohttp.web.Response:
        response = aiohttp.web.json_response(obj, status=status)
        for warning in warnings:
            escaped = warning.replace("\\", "\\\\").replace('"', '\\"')
            response.headers.add("Warning", f'299 - "{escaped}"')  # RFC 7234 warn-text, quotes escaped
        return response

    async def _create(self, request: rendering.Request, kind: Kind) -> aiohttp.web.Response:
        data = admission.body(request)
        if not isinstance(data, dict):
            raise refuse(400, "BadRequest", "the body of the request must be a JSON object")
        if data.get("apiVersion", kind.api_version) != kind.api_version:
            raise refuse(
                400,
                "BadRequest",
                f"the API version in the data ({data['apiVersion']}) does not match "
                f"the expected API version ({kind.api_version})",
            )
        space = (data.get("metadata") or {}).get("namespace")
        if kind.namespaced and request.namespace and space and space != request.namespace:
            raise refuse(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        obj = admission.stamp(kind, copy.deepcopy(data), request.namespace)
        space = obj["metadata"].get("namespace")
        if kind.namespaced and self._store.peek((self._namespaces, None, space)) is None:
            raise refuse(404, "NotFound", f'namespaces "{space}" not found', name=space, kind="namespaces")
        if kind.namespaced and self._store.terminating(space):
            name = obj["metadata"].get("name", "")
            raise refuse(
                403,
                "Forbidden",
                f'{kind.plural} "{name}" is forbidden: unable to create new content in namespace {space} '
                "because it is being terminated",
            )
        if kind.kind == "Pod":
            self._admit_service_account(obj)
        if "status" in kind.subresources and kind.kind != "Pod":
            obj.pop("status", None)  # set through the status subresource only
        if kind.kind == "Namespace":
            obj["status"] = {"phase": "Active"}  # as the namespace controller sets it at once
        obj, warnings = admission.admit(request.params, kind, obj, None)
        key: Key = (request.resource, obj["metadata"].get("namespace"), obj["metadata"]["name"])  # type: ignore[assignment]
        if self._store.peek(key) is not None:
            raise refuse(
                409,
                "AlreadyExists",
                f'{kind.qualified} "{key[2]}" already exists',
                name=key[2],
                group=kind.group,
                kind=kind.plural,
            )
        if kind.kind == "CustomResourceDefinition":
            for served in discovery.kinds_of_crd(obj):
                self._register(served)
            obj["status"] = {"conditions": [{"type": "Established", "status": "True"}]}
        if request.params.get("dryRun") != "All":
            obj = await self._store.put(key, obj, "ADDED")
        return self._answer(obj, 201, warnings)

    async def _update(self, request: rendering.Request, kind: Kind, key: Key) -> aiohttp.web.Response:
        data = admission.body(request)
        content_type = request.headers.get("Content-Type", "").split(";")[0]
        old = self._store.get(key)
        if old is None:
            if content_type == "application/apply-patch+yaml":  # server-side apply creates
                return await self._create(request, kind)
            self._existing(kind, key)
        assert old is not None
        if request.method.value.upper() == "PUT" or content_type == "application/json-patch+json":
            if not isinstance(data, (dict, list)):
                raise refuse(400, "BadRequest", "the body of the request must be a JSON object")
            try:
                new = dict(dicts.patch_dict(old, data)) if isinstance(data, list) else copy.deepcopy(data)
            except Exception as exc:  # jsonpatch's errors: a test that failed, a path that is not there
                raise refuse(422, "Invalid", f"the JSON patch could not be applied: {exc}") from None
        elif isinstance(data, dict):
            new = dict(dicts.patch_dict(old, data))  # copy-on-write over our own copy
        else:
            raise refuse(400, "BadRequest", "the body of the request must be a JSON object")
        wanted = (data.get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None
        if wanted and str(wanted) != old["metadata"]["resourceVersion"]:
            raise refuse(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {kind.qualified} "{key[2]}": the '
                "object has been modified; please apply your changes to the latest version and try again",
                name=key[2],
                group=kind.group,
                kind=kind.plural,
            )
        new = admission.owned_parts(kind, request.subresource, old, new)
        if new == old:
            return self._answer(self._stamp_kind(kind, old), 200, [])
        if new.get("spec") != old.get("spec") and "generation" in old["metadata"]:
            new["metadata"]["generation"] = int(old["metadata"]["generation"]) + 1
        new, warnings = admission.admit(request.params, kind, new, old)
        if request.params.get("dryRun") == "All":
            return self._answer(new, 200, warnings)
        if await self._store.released(key, new):
            return self._answer(new, 200, warnings)
        return self._answer(await self._store.put(key, new, "MODIFIED"), 200, warnings)

    async def _delete(self, request: rendering.Request, kind: Kind, key: Key) -> aiohttp.web.Response:
        options = request.data if isinstance(request.data, dict) else {}
        policy = options.get("propagationPolicy") or request.params.get("propagationPolicy") or "Background"
        if options.get("orphanDependents") is True:
            policy = "Orphan"
        old = self._existing(kind, key)
        preconditions = options.get("preconditions") or {}
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) and preconditions[field] != old["metadata"].get(field):
                raise refuse(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {kind.qualified} "{key[2]}": '
                    f"Precondition failed: {field} in precondition: {preconditions[field]}, "
                    f"{field} in object meta: {old['metadata'].get(field)}",
                )
        if kind.kind == "Namespace" and key[2] in UNDELETABLE_NAMESPACES:
            raise refuse(
                403,
                "Forbidden",
                f'namespaces "{key[2]}" is forbidden: this namespace may not be deleted',
                name=key[2],
                kind="namespaces",
            )
        if request.params.get("dryRun") == "All" or options.get("dryRun"):
            return self._answer(old, 200, [])
        if kind.kind == "Namespace":
            last = await self._store.delete_namespace(key)
        else:
            raw = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
            try:
                grace = None if raw is None else int(raw)
            except (TypeError, ValueError):
                raise refuse(400, "BadRequest", f"gracePeriodSeconds: {raw!r} is not an integer") from None
            last = await self._store.delete(key, policy, grace)
        return self._answer(self._stamp_kind(kind, last or old), 200, [])

    # ---- kmock's request record -----------------------------------------------------------------------
    def _forget(self, request: rendering.Request) -> None:
        """Drop an answered request from kmock's records, the server's and the serving reaction's (routing
        a request filters the whole server record, so a growing record makes every request slower, and a
        long-running local stack would keep every request in memory)."""
        for record in (self._requests, *(payload._requests for payload in self._payloads)):
            for index in range(len(record) - 1, -1, -1):
                if record[index] is request:
                    del record[index]
                    break


def _resource(path: parsing.ParsedPath) -> references.resource | None:
    """The resource of a parsed path, None outside /api and /apis (as kmock's own parsing gives)."""
    if path.group is None:
        return None
    return references.resource(group=path.group, version=path.version, plural=path.plural)
