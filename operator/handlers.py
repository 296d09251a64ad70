"""kopf handlers: thin glue between kopf's watches and `JobController`. Run with `rjob operator` (or
`kopf run -m resilientjob.operator.handlers`).

- each ResilientJob gets a daemon that owns its controller (validate, create objects, reconcile loop) and
  stops with the job; kopf restarts it with backoff when it raises TemporaryError;
- pod events of managed pods go straight to their job's controller and wake its loop, so a deleted or
  failed pod is acted on within one event round-trip instead of a poll period;
- job deletion removes the job's Redis keys (pods go with their owner reference).

The operator's settings (`OperatorSettings`, from the `RJOB_*` environment variables) are read once when the
operator starts, not at import, and travel to the handlers in kopf's `memo`: `rjob operator` puts the
settings its flags and the environment give into the memo it starts kopf with; under `kopf run` the first
activity handler (startup or login, which kopf may run side by side) reads the environment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
from prometheus_client import start_http_server
from redis.exceptions import RedisError

from resilientjob.planner.errors import PlannerError

from . import api, metrics
from ._manifests import LABEL_JOB, LABEL_MANAGED_BY, MANAGER
from ._redis_watch import forget_job, forget_keys, job_client
from ._worker_defaults import load_worker_defaults
from .kube import KubeApi
from .reconciler import InvalidJob, JobController
from .settings import OperatorSettings

# A deleted job's Redis clean-up: attempts and the pause between them (the job waits for them).
FORGET_ATTEMPTS = 5
FORGET_RETRY_DELAY_S = 2.0


@dataclass(slots=True)
class Shared:
    """What the handlers share for the operator's lifetime, in kopf's memo rather than module globals (two
    operators in one process keep theirs apart). Made by the first activity handler in the operator-wide
    memo; the memo a resource handler gets is a shallow copy of that one, so every handler sees this
    object."""

    api: KubeApi | None = None
    """The operator's own API client (made at login, credentials renewed in place)."""
    controllers: dict[tuple[str, str], JobController] = field(default_factory=dict)
    """Each running job's controller by (namespace, name), owned by the job's daemon."""


def shared_of(memo: kopf.Memo) -> Shared:
    """The operator's `Shared` in `memo` (made once: `setdefault` is atomic, and kopf may run the sync
    activity handlers side by side in threads)."""
    found = memo.get("rjob_shared")
    return found if isinstance(found, Shared) else memo.setdefault("rjob_shared", Shared())


def settings_of(memo: kopf.Memo) -> OperatorSettings:
    """The operator's settings in `memo`, read from the environment the first time they are asked for."""
    settings = memo.get("rjob")
    if not isinstance(settings, OperatorSettings):
        settings = memo["rjob"] = OperatorSettings.from_env()
    return settings


def _connection(
    settings: kopf.OperatorSettings, logger: kopf.Logger, rjob: OperatorSettings
) -> kopf.ConnectionInfo:
    if rjob.api_url:
        token = None
        if rjob.api_token_file:
            try:
                token = Path(rjob.api_token_file).read_text().strip()
            except OSError as exc:
                raise kopf.LoginError(f"api_token_file: cannot read {rjob.api_token_file!r}: {exc}") from None
        return kopf.ConnectionInfo(
            server=rjob.api_url,
            insecure=True,
            default_namespace="default",
            scheme="Bearer" if token else None,
            token=token,
        )
    if rjob.kubeconfig:
        import os

        os.environ["KUBECONFIG"] = rjob.kubeconfig
    info = kopf.login_with_service_account(logger=logger, settings=settings) or kopf.login_with_kubeconfig(
        logger=logger, settings=settings
    )
    if info is None:
        raise kopf.LoginError("no in-cluster service account and no kubeconfig found")
    return info


@kopf.on.login()
def login(
    settings: kopf.OperatorSettings, logger: kopf.Logger, memo: kopf.Memo, **_: Any
) -> kopf.ConnectionInfo:
    # kopf calls this again when one of its requests gets 401 (credentials rotated); the operator's own
    # client then takes the new credentials in place, as it does itself on a 401 (`KubeApi.relogin`).
    rjob, shared = settings_of(memo), shared_of(memo)
    info = _connection(settings, logger, rjob)
    if shared.api is not None:
        shared.api.use(info)
    else:
        shared.api = KubeApi(info, relogin=lambda: _connection(settings, logger, rjob))
    return info


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo | None = None, **_: Any) -> None:
    memo = memo if memo is not None else kopf.Memo()
    rjob = settings_of(memo)
    shared_of(memo)
    # Progress and diff-base in annotations: the status schema is strict and belongs to the API models.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="resilientjob.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="resilientjob.io", key="last-handled-configuration"
    )
    settings.persistence.finalizer = "resilientjob.io/finalizer"
    # Explicit decisions go out with kopf.event at any level; handler chatter ("Handler 'pod_event'
    # succeeded", once per pod event) must not become one API call per event on a job of thousands of pods.
    settings.posting.level = logging.WARNING
    settings.peering.standalone = rjob.standalone
    settings.peering.name = "resilientjob"
    settings.peering.mandatory = False
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30
    if rjob.metrics_port:
        try:
            start_http_server(rjob.metrics_port)
        except OSError as error:
            # One line, and soon again: a port a previous process still holds is free in seconds.
            raise kopf.TemporaryError(
                f"RJOB_METRICS_PORT={rjob.metrics_port}: cannot serve metrics there ({error.strerror})",
                delay=5,
            ) from None
    if rjob.worker_defaults:
        # Fail at start, naming the field, rather than create pods that never schedule.
        load_worker_defaults(rjob.worker_defaults)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    shared = shared_of(memo)
    for controller in list(shared.controllers.values()):
        await controller.close()
    if shared.api is not None:
        await shared.api.close()


def _api(shared: Shared) -> KubeApi:
    if shared.api is None:
        raise kopf.TemporaryError("not logged in yet", delay=1.0)
    return shared.api


@kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, cancellation_timeout=2.0, backoff=1.0)  # type: ignore[arg-type]
async def run_job(
    body: kopf.Body,
    name: str,
    namespace: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """The job's controller for as long as the job exists (restarted by kopf on errors, with backoff).

    A controller outlives a daemon that kopf restarts after an error (its caches, its Redis client), but
    never its job: one of the same name with another uid (deleted and applied again) gets a new one, and a
    controller whose `run` returned (the job succeeded) is closed, as kopf will not run its daemon again."""
    key, controllers = (namespace, name), shared_of(memo).controllers
    uid = str(body.get("metadata", {}).get("uid") or "")
    controller = controllers.get(key)
    if controller is not None and controller.uid != uid:
        controllers.pop(key, None)
        await controller.close()
        controller = None
    if controller is None:
        controller = JobController(_api(shared_of(memo)), settings_of(memo), namespace, name, uid)
    controllers[key] = controller
    ended = False
    controller.running = True
    try:
        await controller.setup(body)
        await controller.run(stopped)
        ended = True
    except InvalidJob as exc:
        logger.warning(f"job not runnable: {exc}")
        await stopped.wait()
    finally:
        controller.running = False
        if (stopped or ended) and controllers.get(key) is controller:
            controllers.pop(key, None)
            await controller.close()


async def idle_controller(
    controllers: dict[tuple[str, str], JobController], key: tuple[str, str], uid: str
) -> None:
    """Close and drop the controller of a deleted job (`uid`) that no daemon runs: one whose daemon failed
    and was waiting out kopf's backoff when the job was deleted. kopf starts no daemon for a deleted job,
    so nothing else would close it (its Redis client, its tasks) while the operator lives. A controller a
    daemon still runs is closed by that daemon as it stops; closing twice is harmless."""
    controller = controllers.get(key)
    if controller is not None and controller.uid == uid and not controller.running:
        controllers.pop(key, None)
        await controller.close()


@kopf.on.event("v1", "pods", labels={LABEL_MANAGED_BY: MANAGER})
def pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    pod = event["object"]
    meta = pod.get("metadata") or {}
    # The owner names the job (the job label holds a hashed form of a name longer than a label value).
    refs = meta.get("ownerReferences")
    owners = [r for r in refs if r.get("kind") == api.KIND] if isinstance(refs, list) else []
    job = owners[0].get("name") if owners else (meta.get("labels") or {}).get(LABEL_JOB)
    controllers = shared_of(memo).controllers
    controller = controllers.get((str(meta.get("namespace")), job)) if job else None
    if controller is not None and controller.uid and (not owners or owners[0].get("uid") != controller.uid):
        # A pod of an earlier job of the same name, still being deleted or orphaned by a delete with
        # --cascade=orphan (`_lifecycle`): none of this job's, whatever its labels say.
        return
    if controller is not None:
        controller.observe_pod(pod, deleted=event.get("type") == "DELETED")


@kopf.on.delete(api.GROUP, api.VERSION, api.PLURAL, optional=True)  # type: ignore[arg-type]
async def forget(
    spec: kopf.Spec,
    name: str,
    namespace: str,
    uid: str,
    retry: int,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Remove a deleted job's Redis keys with a client of this handler's own: the job's daemon, stopping at
    the same moment, closes the controller's. Redis is not the job's record, so an unreachable Redis delays
    the deletion by a few short retries, never by kopf's default minute, and then lets the job go. Its
    metric series go too, and its controller, when no daemon holds it (`idle_controller`)."""
    metrics.forget_job(name)
    await idle_controller(shared_of(memo).controllers, (namespace, name), uid)
    settings = settings_of(memo)
    try:
        parsed = api.parse_spec(dict(spec))
    except PlannerError:  # an invalid job never got a controller; its keys, if any, are under the default URL
        parsed = None
    try:
        if parsed is None:
            await forget_job(settings.redis_url, namespace, name)
        else:
            client = await job_client(
                _api(shared_of(memo)), namespace, parsed, settings.redis_url, bounded=False
            )
            await forget_keys(client, namespace, name)
    except (RedisError, kopf.TemporaryError) as exc:  # Redis away, or the password's Secret gone already
        if retry + 1 < FORGET_ATTEMPTS:
            raise kopf.TemporaryError(f"Redis clean-up: {exc}", delay=FORGET_RETRY_DELAY_S) from None
        logger.warning(f"the job's Redis keys were left after {FORGET_ATTEMPTS} attempts: {exc}")
