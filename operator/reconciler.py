"""One ResilientJob's controller: create its objects, watch its workers, and publish new generations.

Each pass observes (pods from watch events, confirmed by a GET before acting; heartbeat keys; telemetry
streams), decides with the pure rules in `_decide` and the planner, and applies. A generation is committed
by recording it in the plan ConfigMap, durable, before it is announced in Redis (`_durable`); everything
after the commit (Redis, pod annotations, status, Event) is idempotent and is finished by whichever pass sees
Redis or the status lagging behind the record, including the first pass of a restarted operator. So a
SIGKILL at any point neither loses nor repeats a decision, and a Redis that lost its state is rebuilt from
the record. Missing heartbeats count only while Redis has been up a full TTL (`_redis_watch`).

Scale and a slow planner: one pass costs one Redis script call for the liveness of every node (plus one
stream read), whatever the job's size. Deciding a new generation (planner, commit, apply) runs as a
background task, one at a time; meanwhile the passes go on, so a node that fails during a long replan is
still detected and fenced within the heartbeat TTL, and is planned around by the next decision.

The telemetry half of each pass (throughput, fail-slow reports, profiles and validation) is in
`_telemetry_pass`; the plans of fail-slow mitigations in `_mitigation`; both come back here to publish.

Why this module is past 600 lines: `JobController` is the one place where a job's observations meet its
side effects, in the order a pass needs them; every rule it applies is decided elsewhere, pure where it can
be (`_decide`, `_whole_job`, `_capacity`, `_fencing`, `_aborts`, `_lifecycle`, `_profile_source`, `_durable`,
`_store`, `planning`), and what is left here is the sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, NoReturn, cast

import kopf
from redis.exceptions import RedisError

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.plan import Plan, Policy
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import PlanAnnouncement

from . import (
    _aborts,
    _capacity,
    _decide,
    _durable,
    _failslow,
    _lifecycle,
    _manifests,
    _profile_source,
    _whole_job,
    _workers_ready,
    api,
    metrics,
)
from ._fencing import Fenced, Fencing
from ._mitigation import mitigation_message
from ._pods import WorkerPods
from ._redis_state import HeartbeatScan, JobRedis, Published, announcement
from ._redis_watch import REDIS_DOWN, RedisWatch, job_client
from ._store import StoreKeeper, rendezvous_again
from ._telemetry_pass import PassContext, TelemetryPass, restore_failslow
from ._worker_defaults import load_worker_defaults
from .kube import KubeApi, KubeError, PodsRefused, core_path, custom_path
from .planning import (
    NODE_LOCAL_CHECKPOINTS,
    PlannerInputs,
    plan_initial,
    plan_next,
    planner_inputs,
    profile_from_pod,
    warm_planner,
    warn_node_local_checkpoints,
)
from .settings import OperatorSettings

log = logging.getLogger("resilientjob.operator")

POD_NAMED = re.compile(r'\bpods? "[^"]*"')
"""A pod's name in an API server's refusal (`pods "job-node-7" is forbidden: ...`)."""


class InvalidJob(Exception):
    """The spec cannot run; the condition and Event are already recorded."""


class JobController:
    """State and actions for one job, owned by its kopf daemon."""

    def __init__(
        self, kube: KubeApi, settings: OperatorSettings, namespace: str, name: str, uid: str = ""
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.namespace = namespace
        self.name = name
        self.uid = uid
        """The job's `metadata.uid`: a job deleted and applied again under the same name is another job."""
        self.wakeup = asyncio.Event()
        self.running = False
        """Whether a kopf daemon runs this controller now (`handlers.run_job`)."""
        self.workers = WorkerPods(kube, namespace, name, self.wakeup)
        self.spec: api.ResilientJobSpec | None = None
        self.inputs: PlannerInputs | None = None
        self._warm_up: asyncio.Task[int] | None = None
        self.redis: JobRedis | None = None
        self.failslow: _failslow.FailSlowTracker | None = None
        self.body: Mapping[str, Any] = {}
        self.status = api.ResilientJobStatus()
        self._written_status: dict[str, Any] | None = None
        self._status_due = 0.0
        self._published: Published | None = None
        self._deciding: asyncio.Task[None] | None = None
        self._telemetry = TelemetryPass()
        self._failslow_restored = False
        self._declined: tuple[int, frozenset[int]] = (-1, frozenset())
        """Joined nodes the planner left idle, and under which generation (`_decline_joins`)."""
        self._joins_since: float | None = None
        """When the joins now waiting were first seen ready (`_joins_settled`); None: none waits."""
        self._joins_held = ""
        """Why they wait, as last logged."""
        self.store = StoreKeeper(kube, namespace, name)
        self.record = _durable.PlanRecord(kube, namespace, name)
        self.watch = RedisWatch(name)
        self.capacity = _capacity.CapacityKeeper(
            _capacity.Backoff(settings.replace_backoff_s, settings.replace_backoff_max_s)
        )
        self.fencing = Fencing(self, self.workers, self.capacity)
        self.aborts = _aborts.AbortWatch()
        """The current generation's abandoned steps with no node dead (`_aborts`)."""
        self._told_not_starting: set[tuple[str, str]] = set()
        """(reason, message) of the containers that do not start, already told in an Event."""
        self._refused: dict[str, str] = {}
        """The API server's refusals of the job's pods, by what it refused ('worker pods', 'store pod'),
        until a later try succeeds (`_pods_refused`; the WorkersReady condition shows them)."""

    def _event_body(self) -> kopf.Body:
        # kopf.event needs apiVersion/kind/metadata of the involved object; it accepts any such mapping.
        return cast(kopf.Body, dict(self.body))

    # ---- paths ---------------------------------------------------------------------------------------
    def _job_path(self, status: bool = False) -> str:
        path = custom_path(api.GROUP, api.VERSION, self.namespace, api.PLURAL, self.name)
        return path + "/status" if status else path

    @property
    def pods(self) -> dict[int, _decide.PodView]:
        """The job's worker pods by node, as the watch and the relists left them (`_pods`)."""
        return self.workers.views

    # ---- pod events (from the kopf pod watch) -----------------------------------------------------------
    def observe_pod(self, pod: Mapping[str, Any], deleted: bool) -> None:
        stuck = None if deleted else _decide.not_starting(pod)
        meta = pod.get("metadata") or {}
        if stuck is not None and self.body and stuck not in self._told_not_starting:
            # Pending for ever otherwise, with nothing in the job's Events: a Secret its env names that is
            # not there, an image that cannot be pulled. Once per cause, not once per pod (every pod of the
            # job meets the same missing Secret; the WorkersReady condition counts them), until every
            # worker runs again (`_workers_ready`).
            self._told_not_starting.add(stuck)
            said = f"pod {meta.get('name')} does not start: {stuck[0]}" + (
                f": {stuck[1]}" if stuck[1] else ""
            )
            self.event("Warning", api.Reason.POD_NOT_STARTING, said)
        if self.store.observe(pod, deleted):
            self.wakeup.set()  # a store pod gone or Failed is created again (`reconcile_once`)
            return
        self.workers.observe(pod, deleted)

    # ---- setup ---------------------------------------------------------------------------------------
    async def setup(self, body: Mapping[str, Any]) -> None:
        """Validate and connect; raises InvalidJob after recording why (condition + Event, no pods)."""
        self.body = body
        self.status = api.parse_status(body.get("status"))
        if self.status.phase in (api.Phase.SUCCEEDED, api.Phase.FAILED):
            # Ended before this daemon (`_lifecycle.ended`, in `run`): nothing of its spec is read again. A
            # profile ConfigMap or Secret cleaned up since must not turn a Succeeded job into a Failed one.
            return
        try:
            spec = api.parse_spec(body.get("spec"))
            referenced = await _profile_source.referenced_profile(self.kube, self.namespace, self.name, spec)
            # None: only node 0's agent can make the profile; `run` waits for it (`_profile_source`).
            waiting = referenced is None and profile_from_pod(spec)
            inputs = None if waiting else planner_inputs(spec, referenced)
        except PlannerError as exc:
            await self._reject(exc)
            raise InvalidJob(str(exc)) from None
        self.spec = spec
        self._use_inputs(inputs)
        if self.failslow is None or self.failslow.spec != spec.fail_slow:
            self.failslow = _failslow.FailSlowTracker(spec.fail_slow)
        if self.redis is None:
            client = await job_client(self.kube, self.namespace, spec, self.settings.redis_url)
            self.redis = JobRedis(client, JobKeys(self.namespace, self.name))

    def _use_inputs(self, inputs: PlannerInputs | None) -> None:
        if inputs is not None and self.inputs != inputs:
            # Off the event loop and ahead of any failure; kept referenced so it is not collected mid-run.
            self._warm_up = asyncio.create_task(asyncio.to_thread(warm_planner, inputs))
        self.inputs = inputs

    async def _reject(self, error: PlannerError, reason: api.Reason = api.Reason.INVALID_SPEC) -> None:
        metrics.INVALID_JOBS.inc()
        conditions = _decide.set_condition(
            self.status.conditions, api.ConditionType.VALID, False, reason, str(error)
        )
        conditions = _workers_ready.failed(conditions, reason, str(error))
        self.status = self.status.model_copy(update={"phase": api.Phase.FAILED, "conditions": conditions})
        await self._write_status(force=True)
        self.event("Warning", reason, str(error))

    async def _before_first_plan(self) -> bool:
        """Whether node 0 must answer before generation 0: the job has no plan yet (in its status or in
        Redis) and either trains through the runtime (node 0 checks the workload) or has no profile yet."""
        spec = self.require_spec()
        if self.status.plan_generation >= 0:
            return False
        if not _profile_source.needs_preflight(spec, has_inputs=self.inputs is not None):
            return False
        if self.inputs is None or self.redis is None:
            return True
        try:
            return await self.redis.published() is None
        except (RedisError, OSError):
            return True  # the pre-flight itself waits for Redis

    # ---- initial generation --------------------------------------------------------------------------
    async def ensure_started(self) -> PlanAnnouncement:
        """Generation 0 committed, and the Service, plan ConfigMap and pods created (all idempotent)."""
        spec, inputs, redis = self.require()
        published = await self.record.reconcile(redis, self.body, self.watch)
        if published is None:
            try:
                plan = plan_initial(spec, inputs)
            except PlannerError as exc:
                await self._infeasible(exc)  # and the pods of node 0's workload check, if any
                raise InvalidJob(str(exc)) from None
            message = announcement(plan, trigger=api.Reason.PLANNED, nodes=plan.nodes, reason="initial plan")
            published = await self.record.commit(redis, self.body, message, None, self.status.plan_generation)
            if published is None:  # unreachable: no record, so none newer than the first plan
                raise kopf.TemporaryError("a plan was recorded meanwhile", delay=1.0)
            if warn_node_local_checkpoints(spec):  # said once, with the first plan: a restart starts over
                self.event("Warning", api.Reason.CHECKPOINT_NODE_LOCAL, NODE_LOCAL_CHECKPOINTS)
        conditions = _decide.set_condition(
            self.status.conditions, api.ConditionType.VALID, True, api.Reason.SPEC_VALID, "spec accepted"
        )
        self.status = self.status.model_copy(update={"conditions": conditions})
        await self.record.write(self.body, published)
        # Every pod at the first start only: later, a missing pod is a failure to detect and plan around
        # (an operator restarted right after a pod kill must not bring the node back), never a pod to make.
        nodes = _durable.pods_to_create(
            published, self.status.plan_generation, self.status.fenced_nodes, spec.nodes
        )
        await self.create_pods(nodes, published.generation, published.layout)
        return published

    async def create_pods(
        self, nodes: Iterable[int], generation: int, layout: str, strikes: Mapping[int, int] | None = None
    ) -> None:
        """The Service and these nodes' pods (idempotent: existing ones are left as they are); `strikes`:
        the crash-loop count a replacement pod carries (`_capacity`)."""
        spec = self.require_spec()
        await self.kube.create(core_path(self.namespace, "services"), _manifests.service_manifest(self.body))
        await self.ensure_store()

        def manifest(node: int) -> dict[str, Any]:
            made = _manifests.pod_manifest(
                self.body, spec, node, generation, layout, redis_url=self._redis_url()
            )
            if self.settings.worker_defaults:
                made = load_worker_defaults(self.settings.worker_defaults).apply(made)
            if strikes and strikes.get(node):
                made["metadata"]["annotations"][_manifests.ANNOTATION_STRIKES] = str(strikes[node])
            return made

        async with self._pods_refused("worker pods"):
            await self.workers.create([manifest(node) for node in nodes], self.observe_pod)

    @contextlib.asynccontextmanager
    async def _pods_refused(self, what: str) -> AsyncIterator[None]:
        """A pod the API server refuses (a ServiceAccount or PriorityClass that does not exist, a quota, an
        admission policy): a Warning Event with the server's words (again only when they change), the
        WorkersReady condition saying so until a later try of `what` succeeds, and the job's daemon tries
        again `pods_refused_retry_s` later (the missing object may be created meanwhile), instead of a
        traceback a second."""
        try:
            yield
        except KubeError as exc:
            if exc.status not in (400, 403, 422):
                raise
            # 422 (an object the server finds invalid) comes back on every try: the spec must change.
            fix = " (delete the job and apply it with that changed)" if exc.status == 422 else ""
            # The server names the pod, and each replacement asked for again has another name: without it,
            # a refusal that comes back alike is the same refusal (one Event, a condition that holds still).
            words = POD_NAMED.sub("a pod", exc.said)
            said = f"the API server refused the job's {what} (HTTP {exc.status}): {words}{fix}"
            if self._refused.get(what) != said:  # once per refusal: the condition keeps it meanwhile
                self.event("Warning", api.Reason.PODS_REFUSED, said)
            self._refused[what] = said
            self._workers_ready()
            with contextlib.suppress(KubeError):  # the retry below must not become a traceback a second
                await self.write_status(force=True)  # `kubectl get rjob` shows the job Pending, not blank
            raise PodsRefused(f"pods refused: {exc}", delay=self.settings.pods_refused_retry_s) from None
        self._refused.pop(what, None)

    def _workers_ready(self, plan_nodes: Iterable[int] | None = None) -> bool:
        """The WorkersReady condition as the job's pods and the plan's nodes (by default the current
        plan's) are now; True when it changed. A refusal of worker pods counts while pods are still wanted
        (no plan yet, a plan node without a pod, replacements waiting): one whose pods are no longer asked
        for (the replacement dropped, the job at its last step) must not hide every later cause."""
        if plan_nodes is None:
            plan_nodes = self._published.plan_nodes if self._published is not None else ()
        planned = sorted(set(plan_nodes))
        wanted = (
            self._published is None
            or bool(self.status.capacity.waiting)
            or any(node not in self.pods for node in planned)
        )
        if not wanted:
            self._refused.pop("worker pods", None)
        refused = "; ".join(self._refused[what] for what in sorted(self._refused))
        before = self.status.conditions
        conditions = _workers_ready.workers_ready(before, planned, self.pods, refused, self.fencing.fenced)
        if conditions is before:
            return False
        self.status = self.status.model_copy(update={"conditions": conditions})
        ready = next(c for c in conditions if c.type == api.ConditionType.WORKERS_READY)
        was = next((c for c in before if c.type == api.ConditionType.WORKERS_READY), None)
        if ready.status == "True":
            self._told_not_starting.clear()  # a cause that comes back is told again
            if was is not None and was.reason in _workers_ready.HELD_UP:
                # The failures were told in Warnings; so is their end, for `kubectl get events`.
                self.event("Normal", api.Reason.ALL_WORKERS_RUNNING, f"{ready.message} (was {was.reason})")
        return True

    async def ensure_store(self) -> None:
        """The job's store pod, created (again) when missing (`_store`)."""
        async with self._pods_refused("store pod"):
            await self.store.ensure(
                self.body, self.require_spec(), self._redis_url(), self.settings.worker_defaults
            )

    def _redis_url(self) -> str:
        return self.require_spec().redis.url or self.settings.redis_url

    def require(self) -> tuple[api.ResilientJobSpec, PlannerInputs, JobRedis]:
        if self.spec is None or self.inputs is None or self.redis is None:
            raise RuntimeError("JobController.setup() must succeed first")
        return self.spec, self.inputs, self.redis

    def require_spec(self) -> api.ResilientJobSpec:
        if self.spec is None:
            raise RuntimeError("JobController.setup() must succeed first")
        return self.spec

    def tracker(self) -> _failslow.FailSlowTracker:
        """The job's fail-slow tracker (made by `setup`)."""
        if self.failslow is None:
            raise RuntimeError("JobController.setup() must succeed first")
        return self.failslow

    async def _infeasible(self, error: PlannerError, reason: api.Reason = api.Reason.PLAN_INFEASIBLE) -> None:
        """The job fails: no plan can run it. Its pods go (workers, replacements, the store): they hold
        devices, and nothing will train on them."""
        conditions = _decide.set_condition(
            self.status.conditions, api.ConditionType.PLANNED, False, reason, str(error)
        )
        conditions = _workers_ready.failed(conditions, reason, str(error))
        self.status = self.status.model_copy(update={"phase": api.Phase.FAILED, "conditions": conditions})
        await self._write_status(force=True)
        self.event("Warning", reason, str(error))
        await self.workers.delete_all()

    # ---- applying a committed generation -------------------------------------------------------------
    async def apply(self, message: PlanAnnouncement) -> None:
        """Bring the ConfigMap, pod annotations, status and Events in line with a committed generation."""
        await self.record.write(self.body, message)
        # Parked slow nodes and replacement pods not in the plan yet follow the generations too: they run
        # probe steps and may (re)join.
        live = {node for node in self.pods if self.workers.running(node)}
        targets = sorted(set(message.plan.nodes) | set(message.parked) | live)
        await self.workers.annotate(targets, message.generation, message.layout)
        alive = sum(1 for node in message.plan.nodes if self.workers.working(node))
        done = _decide.applied(self.status, message, alive, self.require_spec().nodes)
        if not done.first:
            metrics.RECONFIGURATIONS.labels(self.name, message.policy).inc()
        self.status = done.status
        self._workers_ready(message.plan.nodes)  # in the same write: not blank, nor a refusal just over
        await self._write_status(force=True)
        metrics.PLAN_GENERATION.labels(self.name).set(message.generation)
        if done.trigger is api.Reason.COLLECTIVE_FAILED and not done.first:
            return  # its Warning said it all, with the generation (`_aborted`): no planner ran to explain
        self.event(
            "Normal", api.Reason.PLANNED if done.first else done.trigger, _decide.explain(done.decision)
        )

    # ---- the loop ------------------------------------------------------------------------------------
    async def run(self, stopped: kopf.DaemonStopped) -> None:
        """Reconcile until the job is deleted or the operator stops."""
        try:
            if await _lifecycle.ended(self, self.workers):
                return
        except _lifecycle.JobEnded as exc:
            raise InvalidJob(str(exc)) from None
        if not await _lifecycle.earlier_job_gone(self, self.uid, stopped):
            return
        if not await self._claim_keys(stopped):
            return
        if await self._before_first_plan():
            try:
                report = await _profile_source.preflight(self, stopped)
            except _profile_source.WorkloadRejected as exc:
                await self._workload_rejected(exc, "nothing to plan: the workload cannot train")
            except PlannerError as exc:
                await self._infeasible(exc, api.Reason.PROFILE_FAILED)
                raise InvalidJob(str(exc)) from None
            if report is None:
                return
            if report.profile is not None:
                self._use_inputs(planner_inputs(self.require_spec(), report.profile.model_dump(mode="json")))
        published = await self._start_up(stopped)
        if published is None:
            return
        try:
            while not stopped and self.status.phase != api.Phase.SUCCEEDED:
                wait = self.settings.poll_interval_s
                outage: BaseException | None = None
                back_after_s: float | None = None
                try:
                    await self.reconcile_once()
                    back_after_s = self.watch.ok()
                except REDIS_DOWN as exc:
                    wait = max(wait, self.watch.failed(exc))
                    outage = exc
                await self._telemetry_current(outage, back_after_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), wait)
                self.wakeup.clear()
        finally:
            if self._deciding is not None and not self._deciding.done():
                self._deciding.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._deciding

    async def _claim_keys(self, stopped: kopf.DaemonStopped) -> bool:
        """The job's Redis keys made its own (`JobRedis.claim`) before anything reads them, retried while
        Redis is away; False when stopped meanwhile."""
        uid, redis = self.uid, self.redis
        while not stopped and uid and redis is not None:
            try:
                removed = await redis.claim(uid, started=self.status.plan_generation >= 0)
                await self._telemetry_current(None, self.watch.ok())
            except REDIS_DOWN as exc:
                wait = self.watch.failed(exc)
                await self._telemetry_current(exc, None)  # an operator restarted during an outage says so
                await stopped.wait(wait)
                continue
            if removed:
                log.info(
                    "job %s/%s: removed %d Redis keys a deleted job of this name left",
                    self.namespace,
                    self.name,
                    removed,
                )
            return True
        return not stopped

    async def _start_up(self, stopped: kopf.DaemonStopped) -> PlanAnnouncement | None:
        """Generation 0 (or the recorded one, restored into Redis) applied, and a restarted operator's state
        back: its fail-slow episode, its fenced nodes. Retried with backoff while Redis is away; None when
        stopped meanwhile."""
        while not stopped:
            try:
                published = await self.ensure_started()
                if self.status.plan_generation < published.generation:
                    await self.apply(published)
                self._published = Published.of(published)
                if not self._failslow_restored:
                    # Once per process: a restarted operator continues a fail-slow episode where it was.
                    await restore_failslow(self._pass_context())
                    self._failslow_restored = True
                await self._telemetry.resume(self.require()[2])
                await self._telemetry_current(None, self.watch.ok())
                break
            except REDIS_DOWN as exc:
                wait = self.watch.failed(exc)
                await self._telemetry_current(exc, None)
                await stopped.wait(wait)
        else:
            return None
        await self.fencing.restore(self.status.fenced_nodes, published.plan.nodes)
        return published

    async def _current(self) -> tuple[Published, HeartbeatScan]:
        """The committed generation and a liveness scan of its nodes. The plan itself is re-read (and Redis
        brought in line with the durable record) only when the scan shows another generation."""
        redis = self.require()[2]
        cached = self._published
        if cached is not None:
            started = time.monotonic()
            scan = await redis.scan(cached.nodes, cached.nodes_arg)
            self.watch.round_trip(started, time.monotonic())
            generation = cached.message.generation
            if scan.generation == generation == self.record.generation and scan.plan_bytes == cached.size:
                return cached, scan
        message = await self.record.reconcile(redis, self.body, self.watch)
        if message is None:
            message = await self.ensure_started()
        if cached is None or cached.message.generation != message.generation:
            cached = self._published = Published.of(message)
        return cached, await redis.scan(cached.nodes, cached.nodes_arg)

    async def reconcile_once(self) -> None:
        spec = self.require()[0]
        await self.ensure_store()
        deciding = self._deciding is not None and not self._deciding.done()
        if self._deciding is not None and self._deciding.done():
            task, self._deciding = self._deciding, None
            task.result()  # InvalidJob (infeasible) and bugs surface here, in the daemon
        await self.workers.resync()
        outage: BaseException | None = None
        try:
            current, scan = await self._current()
        except REDIS_DOWN as exc:
            if self._published is None:
                raise
            # Redis away: the pods still say which workers died. The committed plan is the one this operator
            # holds (the durable record has no newer one while nobody else decides), heartbeats say nothing,
            # and a decision is recorded in the plan ConfigMap and announced once Redis answers.
            outage, current, scan = exc, self._published, None
        published = current.message
        if not deciding and self.status.plan_generation < published.generation:
            await self.apply(published)
        if not deciding and self.store.replaced:
            self.store.replaced = False
            self._start(lambda: self._rendezvous_again(published))
            deciding = True
        plan = published.plan
        self.fencing.keep_planned(current.plan_nodes)
        expired = self.fencing.expired(scan) if scan is not None else []
        at_last_step = self._trained_to_the_end(spec)  # this pass reads its telemetry after deciding
        if at_last_step:
            # Every worker committed the last step (commits are atomic); they are exporting and exiting, and
            # an agent's heartbeat stops before its pod reports Succeeded: silence now is no failure.
            expired = []
        observed = _decide.Observation(pods=dict(self.pods), expired_heartbeats=frozenset(expired))
        if not deciding and _decide.training_complete(plan, observed):
            await self._complete(published)
            return
        suspects = {
            n: cause
            for n, cause in _decide.detect_failures(plan, observed).items()
            if n not in self.fencing.fenced
        }
        stopped_by_spec = _decide.workload_error(plan, observed)
        if stopped_by_spec is None and suspects:
            # The agent says it in Redis before its heartbeat stops: the pod's own status may come later.
            with contextlib.suppress(*REDIS_DOWN):
                stopped_by_spec = await self.require()[2].workload_error()
        if stopped_by_spec is not None:
            await self._workload_failed(*stopped_by_spec)
        if suspects:
            confirmed = await self.fencing.confirmed(suspects)
            await self.fencing.fence(confirmed)
            if self.failslow is not None:
                self.failslow.forget(confirmed)
        quiet = not (deciding or suspects or self.fencing.fenced or at_last_step)
        if quiet and scan is not None and scan.aborts != 0:
            deciding = await self._aborted(published)  # hung nodes fenced here are planned around below
        if spec.replace_failed_nodes and not at_last_step:
            await self.capacity.keep_up(self, published, self.fencing.fenced)
        # A job at its last step takes no one in: the workers exit before a joiner could rendezvous.
        joins = set() if at_last_step else _decide.detect_joins(plan, observed, published.parked)
        declined = self._declined[1] if self._declined[0] == published.generation else frozenset()
        fresh = _decide.new_joins(joins, [*published.nodes, *declined])
        # Every node of the plan lost at once (a spot reclaim, a drained pool): nobody to plan around, and
        # the planner would fail the job. Its replacements restart it from its checkpoint once they run,
        # joining as joins do (all of them, or those ready within the settle time).
        lost_all = bool(self.fencing.fenced) and not set(plan.nodes) - set(self.fencing.fenced)
        if lost_all and not deciding and at_last_step:
            await self._lost_after_training(spec)
        waits_for_replacements = lost_all and spec.replace_failed_nodes and not at_last_step
        if not fresh or (self.fencing.fenced and not waits_for_replacements):
            self._joins_since = None
        elif not deciding and not await self._joins_settled(published, observed):
            fresh = set()
        if waits_for_replacements and not deciding:
            await self._lost_every_node(published.generation, set(plan.nodes))
            loss = self.status.capacity.whole_job_loss
            if loss is not None and loss.in_a_row > spec.checkpoint.restart_limit:
                fresh = set()  # one past the limit: the next pass ends the job (`_whole_job`); none restarts
        # A job that lost every node has nobody to plan on but its replacements, once they are ready.
        to_plan = fresh if waits_for_replacements else self.fencing.fenced or fresh
        if not deciding and to_plan:
            failures = dict(self.fencing.fenced)
            self._start(lambda: self._reconfigure(published, failures, joins))
            deciding = True
        if self._workers_ready() and outage is not None:
            with contextlib.suppress(KubeError):  # the API server answers while Redis does not
                await self.write_status(force=True)
        if outage is not None:
            raise outage  # the telemetry pass reads Redis; the loop backs off and keeps count of the outage
        outcome = await self._telemetry.run(self._pass_context(), current)
        if self._telemetry.progress is not None:
            self.aborts.stepped(self._telemetry.progress[0])
        self.status = self.status.model_copy(update=outcome.status)
        recoveries = _decide.measured_switches(self.status.recoveries, self._telemetry.switches)
        if recoveries is not None:
            self.status = self.status.model_copy(update={"recoveries": recoveries})
        await self.write_status(force=outcome.force_status)
        if outcome.mitigation is not None and deciding:
            self._telemetry.deferred = outcome.mitigation
        elif outcome.mitigation is not None:
            self.start_mitigation(current.message, outcome.mitigation)

    async def _telemetry_current(self, outage: BaseException | None, back_after_s: float | None) -> None:
        """The TelemetryCurrent condition as Redis is now (`_decide.telemetry_condition`), written at once
        when it changed: the Kubernetes API is up when Redis is not."""
        conditions = _decide.telemetry_condition(
            self.status.conditions, self.watch.down, outage, back_after_s
        )
        if conditions is not self.status.conditions:
            self.status = self.status.model_copy(update={"conditions": conditions})
            await self.write_status(force=True)

    def _pass_context(self) -> PassContext:
        spec, inputs, redis = self.require()
        return PassContext(
            namespace=self.namespace,
            name=self.name,
            redis=redis,
            tracker=self.tracker(),
            profile=inputs.profile,
            validation_timeout_s=spec.fail_slow.validation_timeout_s,
            working=self.workers.working,
            event=self.event,
        )

    async def _lost_every_node(self, generation: int, plan_nodes: set[int]) -> None:
        """Every node of `generation` failed: counted once, said while the replacements come; the job ends
        when it keeps losing them all at the same step (`_whole_job`)."""
        ended = await _whole_job.wait(self, generation, plan_nodes, self.fencing.fenced)
        if ended is not None:
            log.warning("job %s/%s: %s", self.namespace, self.name, ended)
            await self._infeasible(
                PlannerError("checkpoint.restartLimit", ended), api.Reason.RESTART_LIMIT_EXCEEDED
            )
            raise InvalidJob(ended)

    async def _lost_after_training(self, spec: api.ResilientJobSpec) -> NoReturn:
        """Every node failed after the last step committed, while the trained model or the last checkpoint
        was being written: training is done (no replacement is asked for), and nobody is left to finish
        writing. The job fails saying where the trained model is."""
        error = PlannerError(*_decide.lost_after_training(spec))
        log.warning("job %s/%s: %s", self.namespace, self.name, error)
        await self._infeasible(error, api.Reason.LOST_AFTER_TRAINING)
        raise InvalidJob(str(error))

    def _trained_to_the_end(self, spec: api.ResilientJobSpec) -> bool:
        progress = self._telemetry.progress
        synthetic = spec.model.startswith("synthetic:")  # the simulation has no last step
        return not synthetic and progress is not None and progress[1] >= spec.training.steps

    async def _complete(self, published: PlanAnnouncement) -> None:
        """Every worker trained to the end: the job succeeded (its pods stay, Completed, for their logs)."""
        self.status, message = _decide.completed(self.status, published)
        await self._write_status(force=True)
        self.event("Normal", api.Reason.TRAINING_COMPLETE, message)
        log.info("job %s/%s: %s", self.namespace, self.name, message)

    def _start(self, decide: Callable[[], Awaitable[None]]) -> None:
        """Run one decision in the background; its end wakes the loop (to apply it or surface its error)."""

        async def run() -> None:
            try:
                await decide()
            finally:
                self.wakeup.set()

        self._deciding = asyncio.create_task(run(), name=f"decide {self.namespace}/{self.name}")

    async def _workload_failed(self, node: int, field: str, line: str) -> None:
        """A worker stopped because of the job's spec while training (the pre-flight could not see it: a
        bad token past the samples it read, an output directory gone read-only): the job fails naming the
        field, its workers go, and nothing is replanned (every replacement would meet the same)."""
        error = _profile_source.WorkloadRejected(
            field, f"{line.removeprefix(field + ': ')} (found by node {node})"
        )
        await self._workload_rejected(
            error, f"training stopped: the workload cannot go on (found by node {node})"
        )

    async def _workload_rejected(self, error: PlannerError, planned: str) -> NoReturn:
        """The job fails on its workload: Planned=False and Valid=False (InvalidWorkload, the line naming
        the field), an Event, its workers deleted; raises InvalidJob to end its daemon."""
        conditions = _decide.set_condition(
            self.status.conditions, api.ConditionType.PLANNED, False, api.Reason.INVALID_WORKLOAD, planned
        )
        self.status = self.status.model_copy(update={"conditions": conditions})
        await self._reject(error, api.Reason.INVALID_WORKLOAD)
        await self.workers.delete_all()
        raise InvalidJob(str(error)) from None

    async def _stepped_generation(self) -> int | None:
        """The newest generation a worker recorded a step under: from the telemetry read so far, or, in an
        operator that has read none yet (just restarted: it reads only records that come after its start),
        from the stream's newest record. None when unknown (Redis away or emptied)."""
        progress = self._telemetry.progress
        if progress is not None:
            return progress[0]
        with contextlib.suppress(*REDIS_DOWN):
            record = await self.require()[2].latest_iteration()
            return record.generation if record is not None else None
        return None

    async def _joins_settled(self, published: PlanAnnouncement, observed: _decide.Observation) -> bool:
        """Whether the joins seen now go into a generation (`_decide.held_joins`); says once why they wait."""
        now = time.monotonic()
        if self._joins_since is None:
            self._joins_since = now
        held = _decide.held_joins(
            _decide.starting_nodes(published.plan, observed, published.parked),
            await self._stepped_generation(),
            published.generation,
            now - self._joins_since,
            self.settings.join_settle_s,
        )
        if held is None:
            self._joins_since, self._joins_held = None, ""
            return True
        if held != self._joins_held:
            self._joins_held = held
            log.info("job %s/%s: joins wait: %s", self.namespace, self.name, held)
        return False

    async def _reconfigure(
        self, current: PlanAnnouncement, failures: dict[int, Fenced], joins: set[int]
    ) -> None:
        spec, inputs, _ = self.require()
        detect_s = max((f.detect_s for f in failures.values() if f.detect_s is not None), default=0.0)
        trigger = api.Reason.NODE_JOINED if not failures else next(iter(failures.values())).reason
        why = "; ".join(f"node {n}: {f.cause}" for n, f in sorted(failures.items()))
        stepped = await self._stepped_generation()
        unconfirmed = _decide.unconfirmed_copies(current.plan, stepped, current.generation) - set(failures)
        if unconfirmed:
            arrived = (
                "they may not have loaded the checkpoint"
                if current.plan.policy is Policy.CHECKPOINT
                else "their copies may not have arrived"
            )
            why = "; ".join(
                filter(
                    None,
                    [
                        why,
                        f"nodes {sorted(unconfirmed)} counted as holding nothing: no step of generation "
                        f"{current.generation} committed, so {arrived}",
                    ],
                )
            )
        if joins:
            why = "; ".join(filter(None, [why, f"nodes {sorted(joins)} joined"]))
        try:
            # In a worker thread: a replan of thousands of nodes takes long, and meanwhile this loop must
            # keep answering pod events and other jobs' heartbeats.
            plan = await asyncio.to_thread(
                plan_next,
                spec,
                inputs,
                current.plan,
                failed=list(failures),
                joined=joins,
                emptied=sorted(unconfirmed),
                step=self.status.step,
            )
        except PlannerError as exc:
            await self._infeasible(exc)
            raise InvalidJob(str(exc)) from None
        metrics.RECOVERY_SECONDS.labels("plan").observe(plan.planning_s)
        if not failures and _decide.same_work(current.plan, plan):
            await self._decline_joins(current, plan, joins, why)
            return
        nodes = sorted(set(failures) | joins)
        # A fail-stop mid-episode keeps the episode's parked nodes; the healthy plan to restore is void
        # once the layout has changed under it.
        message = announcement(
            plan,
            trigger=trigger,
            nodes=nodes,
            reason=why,
            detect_s=detect_s,
            parked=[n for n in current.parked if self.workers.running(n)],
        )
        await self._commit_and_apply(message, current)

    async def _decline_joins(self, current: PlanAnnouncement, plan: Plan, joins: set[int], why: str) -> None:
        """The planner keeps the layout and leaves the joined nodes idle: nothing changes for any worker, so
        no generation is published (each would rendezvous again for nothing). The decision goes into the
        status and an Event; the nodes are offered again with the next generation."""
        chosen = _decide.declined_joins(current, plan, joins, why)
        self._declined = (current.generation, frozenset(joins))
        self.status = self.status.model_copy(update={"last_decision": chosen})
        await self._write_status(force=True)
        message = f"nodes {sorted(joins)} stay idle under generation {current.generation}: {chosen.reason}"
        self.event("Normal", api.Reason.NODE_JOINED, message)
        log.info("job %s/%s: %s", self.namespace, self.name, message)

    async def _aborted(self, published: PlanAnnouncement) -> bool:
        """Workers abandoned a step of the current generation and no node died (`_aborts`): fence the nodes
        that hang (the pass plans around them), or re-form the world. True when a decision started."""
        try:
            aborts = await self.require()[2].aborts(published.generation)
        except REDIS_DOWN:
            return False  # the rest of the pass runs; the next reads them again
        world = frozenset(published.plan.nodes)
        verdict = self.aborts.observe(published.generation, world, aborts, time.monotonic())
        if verdict is None:
            return False
        what = _aborts.summary(aborts)
        if not self.watch.heartbeats_trusted():
            # Redis was away: a report lost meanwhile comes again with its agent's next beat, and a node
            # that died meanwhile is not fenced yet (its heartbeat says nothing until Redis is trusted).
            return False
        if verdict.hung:
            waited = _aborts.hang_after_s(aborts)
            cause = f"hung: neither stepped nor aborted for {waited:.0f} s while its peers did ({what})"
            self.event("Warning", api.Reason.NODE_HUNG, f"nodes {list(verdict.hung)} {cause}")
            # Its last sign of life: a collective timeout before its peers' first abort was seen, when they
            # began to wait on it.
            now = time.monotonic()
            silent_s = self.aborts.waited_s(now) + max(a.collective_timeout_s for a in aborts.values())
            await self.fencing.fence(
                dict.fromkeys(verdict.hung, (api.Reason.NODE_HUNG, cause)),
                last_seen=dict.fromkeys(verdict.hung, now - silent_s),
            )
            return False
        if not self.aborts.may_reform():
            if self.aborts.gave_up != published.generation:
                self.aborts.gave_up = published.generation
                message = (
                    f"{what}; the world re-formed {_aborts.MAX_REFORMS} times in a row without committing a "
                    "step: no more re-formations, the workers' plan timeout takes over"
                )
                self.event("Warning", api.Reason.COLLECTIVE_FAILED, message)
            return False
        reason = f"{what}; every node alive: the world re-forms with the same layout"
        waited = self.aborts.waited_s(time.monotonic())
        restart = _aborts.switch_failed(aborts) and published.plan.policy is Policy.CHECKPOINT
        reformed = rendezvous_again(
            published,
            api.Reason.COLLECTIVE_FAILED,
            reason,
            detect_s=waited,
            transfers=_aborts.copies_to_carry(published.plan, aborts),
            restart_again=restart,
        )
        # The one Event of a re-formation (`apply` tells no other for it): the generation is named here.
        self.event("Warning", api.Reason.COLLECTIVE_FAILED, f"{reason} (generation {reformed.generation})")
        log.info("job %s/%s: %s", self.namespace, self.name, reason)

        async def reform() -> None:
            if await self._commit_and_apply(reformed, published):
                self.aborts.reforming(reformed.generation)
                if self.failslow is not None:
                    self.failslow.same_layout(published.generation, reformed.generation)

        self._start(reform)
        return True

    async def _rendezvous_again(self, published: PlanAnnouncement) -> None:
        again = rendezvous_again(published)
        if await self._commit_and_apply(again, published) and self.failslow is not None:
            self.failslow.same_layout(published.generation, again.generation)

    async def _commit_and_apply(
        self, message: PlanAnnouncement, current: PlanAnnouncement, failslow: dict[str, Any] | None = None
    ) -> bool:
        """Commit (durable record, then Redis with the fail-slow episode's state for a mitigation), apply.
        False when the record had moved on and nothing was committed."""
        redis = self.require()[2]
        committed = await self.record.commit(
            redis, self.body, message, current.generation, self.status.plan_generation, failslow
        )
        if committed is None:
            return False  # decided on a generation the record has already left: the loop decides again
        self._published = Published.of(committed)
        self.status = self.status.model_copy(update={"phase": api.Phase.RECONFIGURING})
        await self.apply(committed)
        return True

    def start_mitigation(self, current: PlanAnnouncement, mitigation: _failslow.Mitigation) -> None:
        self._start(lambda: self._mitigate(current, mitigation))

    async def _mitigate(self, current: PlanAnnouncement, mitigation: _failslow.Mitigation) -> None:
        """Publish a fail-slow mitigation through the commit path of a fail-stop (S2, S3, S4, restore).

        The episode's state (which already counts this decision) is stored in the commit's transaction:
        an operator killed before the commit restores the state from before the decision and decides
        again; one killed after it finds both the generation and the decision recorded."""
        spec, inputs, redis = self.require()
        tracker = self.tracker()

        def running(node: int) -> bool:
            return self.workers.running(node)

        try:
            message = await mitigation_message(spec, inputs, current, mitigation, running)
            if isinstance(message, str):
                log.info(
                    "job %s/%s: %s not applied: %s", self.namespace, self.name, mitigation.action, message
                )
                self.event(
                    "Normal",
                    api.Reason.NODE_SLOW,
                    f"fail-slow mitigation {mitigation.action} not applied: {message}",
                )
                tracker.not_published(mitigation)
                await redis.save_failslow(tracker.state())
            else:
                metrics.RECOVERY_SECONDS.labels("plan").observe(message.plan.planning_s)
                tracker.published(mitigation, message.generation)
                if not await self._commit_and_apply(message, current, tracker.state()):
                    tracker.not_published(mitigation)
            tracker.changed = False
        finally:
            self._telemetry.holding = False

    def event(self, kind: str, reason: api.Reason, message: str) -> None:
        """A Kubernetes Event on the job with a named reason."""
        kopf.event(self._event_body(), type=kind, reason=reason.value, message=message)

    async def write_status(self, force: bool) -> None:
        await self._write_status(force)

    async def _write_status(self, force: bool) -> None:
        """Patch the status when it changed (and, unless forced, at most every status_interval_s). The
        `rjob_workers_not_ready` series follows the status meant to be written, at every call."""
        metrics.workers_not_ready(self.name, _workers_ready.not_ready(self.status))
        now = time.monotonic()
        if not force and now < self._status_due:
            return  # before serialising: most passes end here
        payload = api.status_patch(self.status)
        if payload == self._written_status:
            return
        await self.kube.patch(self._job_path(status=True), {"status": payload})
        self._written_status = payload
        self._status_due = now + self.settings.status_interval_s

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()
            self.redis = None
