"""A small asynchronous Kubernetes REST client (aiohttp, which kopf already depends on) for the few calls the
operator makes itself: create/get/list/patch/delete of pods, services, config maps and secrets, and status
patches. kopf handles watching, events and its own bookkeeping; this adapter sits behind `KubeApi` so the
reconciler never touches HTTP directly.

Server errors and connection failures become `kopf.TemporaryError` so that kopf retries with backoff; a 401
leads to a fresh login and one retry (credentials rotate); other client errors (4xx other than 404/409) are
bugs or invalid objects and raise `KubeError`.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

MERGE_PATCH = "application/merge-patch+json"


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str, said: str = "") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.said = said or message
        """The server's own words (its Status message), without the request they answer."""


class PodsRefused(kopf.TemporaryError):
    """The API server refused a pod the job needs (already told in a `PodsRefused` Event). Raised out of a
    job's daemon, kopf runs it again after `delay`; a replacement mid-training waits that long instead."""


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    context = ssl.create_default_context(cafile=info.ca_path)
    if info.ca_data:
        context.load_verify_locations(cadata=base64.b64decode(info.ca_data).decode())
    if info.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    cert_path, key_path = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        # ssl wants files; the kubeconfig gave inline data (the usual case for kind clusters).
        cert_file = tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False)  # noqa: SIM115
        key_file = tempfile.NamedTemporaryFile("wb", suffix=".key", delete=False)  # noqa: SIM115
        with cert_file, key_file:
            cert_file.write(base64.b64decode(info.certificate_data))
            key_file.write(base64.b64decode(info.private_key_data))
        cert_path, key_path = cert_file.name, key_file.name
    if cert_path and key_path:
        context.load_cert_chain(cert_path, key_path)
    return context


def core_path(namespace: str, plural: str, name: str | None = None) -> str:
    base = f"/api/v1/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base


def custom_path(group: str, version: str, namespace: str, plural: str, name: str | None = None) -> str:
    base = f"/apis/{group}/{version}/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base


def _authorization(info: kopf.ConnectionInfo) -> dict[str, str]:
    if info.token:
        return {"Authorization": f"{info.scheme or 'Bearer'} {info.token}"}
    if info.username and info.password:
        raw = f"{info.username}:{info.password}".encode()
        return {"Authorization": f"Basic {base64.b64encode(raw).decode()}"}
    return {}


class KubeApi:
    """The operator's own API calls. One aiohttp session, created lazily inside the running loop.

    Credentials can rotate (a service-account token file the kubelet rewrites, a refreshed kubeconfig
    token): a 401 makes the client log in again with `relogin` (which reads them anew) and retry the
    request once; kopf's re-login hands its new credentials over with `use`."""

    def __init__(
        self,
        info: kopf.ConnectionInfo,
        timeout_s: float = 10.0,
        relogin: Callable[[], kopf.ConnectionInfo] | None = None,
    ) -> None:
        self.server = info.server.rstrip("/")
        self._auth = _authorization(info)
        self._ssl = _ssl_context(info)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._relogin = relogin

    def use(self, info: kopf.ConnectionInfo) -> None:
        """Send these credentials from now on (the server and TLS settings stay)."""
        self._auth = _authorization(info)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        status, payload = await self._send(method, path, body, params, content_type)
        if status == 401 and self._relogin is not None:
            self.use(self._relogin())
            status, payload = await self._send(method, path, body, params, content_type)
        if status >= 500 or status == 429:
            raise kopf.TemporaryError(f"{method} {path}: HTTP {status}", delay=1.0)
        if status >= 400 and status not in (404, 409):
            message = payload.get("message", "") if isinstance(payload, dict) else str(payload)
            raise KubeError(status, f"{method} {path}: {message}", said=message)
        return status, payload

    async def _send(
        self, method: str, path: str, body: Any, params: Mapping[str, str] | None, content_type: str
    ) -> tuple[int, Any]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers={"Accept": "application/json"}, timeout=self._timeout
            )
        headers = {**self._auth, **({"Content-Type": content_type} if body is not None else {})}
        try:
            async with self._session.request(
                method, self.server + path, json=body, params=params, headers=headers, ssl=self._ssl
            ) as response:
                payload = await response.json(content_type=None) if response.content_length != 0 else None
                return response.status, payload
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise kopf.TemporaryError(f"{method} {path}: {exc!r}", delay=1.0) from exc

    async def create(self, path: str, body: Mapping[str, Any]) -> bool:
        """Create an object; False when it already exists (creation is idempotent for the reconciler)."""
        status, _ = await self._request("POST", path, body=dict(body))
        return status != 409

    async def get(self, path: str) -> dict[str, Any] | None:
        status, payload = await self._request("GET", path)
        return None if status == 404 else payload

    async def list(self, path: str, label_selector: str = "") -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        status, payload = await self._request("GET", path, params=params)
        if status == 404 or not isinstance(payload, dict):
            return []
        items: list[dict[str, Any]] = payload.get("items") or []
        return items

    async def patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """JSON merge patch; None when the object is gone."""
        status, payload = await self._request("PATCH", path, body=dict(body), content_type=MERGE_PATCH)
        return None if status == 404 else payload

    async def delete(self, path: str, grace_period_s: int | None = None) -> bool:
        """Delete; False when it was already gone."""
        params = {"gracePeriodSeconds": str(grace_period_s)} if grace_period_s is not None else None
        status, _ = await self._request("DELETE", path, params=params)
        return status != 404
