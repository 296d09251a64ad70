"""The test harness's control plane: launch and supervise a job's workers on this machine with torch elastic,
publish plans, fall back to checkpoints. Tests and benchmarks drive the runtime through it; in a cluster the
operator, the store pod and each pod's agent play these parts (nothing in the product imports this).

Each node gets its own `torch.distributed.elastic.multiprocessing` process context (`start_processes`, the
supervision layer `LocalElasticAgent` is built on), exactly as each pod's agent supervises only its own
workers: a dead node therefore never tears down the survivors, who reconfigure live. The rendezvous is driven
by the plan instead of elastic's `RendezvousHandler`: the launcher hosts a `TCPStore`, publishes plan
generation g under `plan/<g>`, and workers re-initialise the default process group under the `gen<g>/`
prefix with the plan's ranks (see `runtime.join_world`). A plan whose stages span k devices gets k workers
per node (local ranks 0..k-1, tensor-parallel within the stage); k is fixed for the job's lifetime.
Workers are restarted only on the fallback path,
when the planner answers `checkpoint` (no live replica of some layer remains) or a failure hits a switch in
progress: every process context is closed and the survivors start again from the last complete checkpoint.

Every decision is the planner's (`plans.RuntimePlanner` over `planner.search.replan`): `policy`
forces one recovery policy or leaves the choice to Odyssey's score (`auto`). The moment a worker's death is
seen, the launcher bumps the store's failure counter, so survivors abandon the step at once
(`agent._runtime_wait`), and only then waits `grace_s` for simultaneous failures before planning once.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import TCPStore
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, Std, start_processes

from resilientjob.agent._runtime_schedule import world_nodes
from resilientjob.agent.config import JobConfig
from resilientjob.agent.hooks import StepHooks
from resilientjob.agent.runtime import check_supported, wait_bound_s
from resilientjob.agent.worker import announce_failures, publish_plan, worker_main
from resilientjob.planner.errors import PlannerError
from resilientjob.planner.plan import Plan, Policy
from resilientjob.protocol.store_keys import (
    COMMITTED_KEY,
    applied_key,
    event_key,
    fail_event_key,
    joining_key,
    loss_key,
    received_key,
    samples_key,
    steptime_key,
    trained_samples,
)

from .faults import CrashAt, CrashAtExport
from .plans import RuntimePlanner

_WORKER_PRELOAD = ["torch", "torch._dynamo", "resilientjob.agent.worker"]
"""What the forkserver imports once for every worker it forks: torch's first optimizer imports torch._dynamo
(2-3 CPU-s), which each worker otherwise paid before its first step."""


@dataclass(slots=True)
class Recovery:
    """One reaction to failures: what happened when (launcher clock, seconds since the epoch)."""

    failed: tuple[int, ...]
    generation: int
    policy: str
    detected_at: float
    planned_at: float
    planning_s: float
    restarted: bool
    committed_before: int


@dataclass(slots=True)
class JobResult:
    """Everything a run left in the store, decoded."""

    losses: dict[int, float]
    samples: dict[int, list[int]]
    received: dict[int, list[tuple[int, int, int, int]]]
    plans: list[Plan]
    recoveries: list[Recovery]
    events: dict[str, Any]
    wall_s: float
    return_values: dict[int, Any] = field(default_factory=dict)
    step_times: dict[int, list[float]] = field(default_factory=dict)
    """Seconds of each committed step, by plan generation, measured by the world's rank 0."""


WORLD_STOPPED_GRACE_S = 3.0
"""Beyond twice the plan's wait bound: how long a world's aborts stand, with no failure seen, before the
run ends with `WorldStopped` (the operator's `ABORT_GRACE_S` is of the same kind)."""


class WorldStopped(RuntimeError):
    """The job's world stopped with every node alive; the harness does not re-form worlds."""


class NodeAgent:
    """One node's supervisor: starts its worker(s) through torch elastic and reports how they ended."""

    def __init__(self, node: int, log_dir: Path, start_method: str) -> None:
        self.node = node
        self.log_dir = log_dir
        self.start_method = start_method
        self.context: PContext | None = None

    def start(self, args: tuple[object, ...], workers: int = 1) -> None:
        """Start `workers` processes (one per device of the node's stage; local rank j gets `j` last)."""
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        if self.start_method == "forkserver":
            # Workers fork from multiprocessing's forkserver with torch and the runtime already imported (3-4
            # CPU-s each otherwise). Only the first start of the forkserver reads this.
            multiprocessing.get_context("forkserver").set_forkserver_preload(_WORKER_PRELOAD)
        self.context = start_processes(
            name=f"rjob-node{self.node}",
            entrypoint=worker_main,
            args={j: (*args, j) for j in range(workers)},
            envs={j: {} for j in range(workers)},
            logs_specs=DefaultLogsSpecs(log_dir=str(self.log_dir / f"node{self.node}"), redirects=Std.ALL),
            start_method=self.start_method,
        )

    def poll(self) -> tuple[bool, bool, Any]:
        """(finished, failed, local rank 0's return value); the node has failed if any of its workers did."""
        if self.context is None:
            raise RuntimeError(f"node {self.node}: poll() before start()")
        result = self.context.wait(timeout=0)
        if result is None:
            return False, False, None
        return True, result.is_failed(), result.return_values.get(0)

    def stop(self) -> None:
        if self.context is not None:
            self.context.close()


class Launcher:
    """Runs a job to `config.steps` committed steps through failures, publishing each new plan."""

    def __init__(
        self,
        config: JobConfig,
        plan: Plan,
        planner: RuntimePlanner,
        log_dir: Path,
        fail_at: Mapping[int, int] | None = None,
        policy: Policy = Policy.AUTO,
        upgrade_after: int | None = None,
        grace_s: float = 0.2,
        start_method: str = "forkserver",
        on_plan: Callable[[Plan], None] | None = None,
        live: bool = True,
        joins: Mapping[int, int] | None = None,
        publish_at: Mapping[int, Plan] | None = None,
        crash_at_export: frozenset[int] = frozenset(),
        hooks: Mapping[int, StepHooks] | None = None,
    ) -> None:
        """`policy` is passed to every replan; `upgrade_after`: once a rerouted plan has committed this many
        steps, publish a dynamic layout over the live nodes (None: stay rerouted until the next change).
        `joins`: new node id -> committed step after which the planner takes that node in (a replacement
        pod joining, as the operator plans it); its workers start with the job, load the model and wait to be
        taken in (`store_keys.joining_key`), as a replacement pod that is running before its plan does.
        `publish_at`: committed step -> a plan of the same nodes to publish then as the next generation (what
        the operator publishes for a fail-slow mitigation). `crash_at_export`: nodes whose worker dies as it
        starts writing the trained model out. `hooks`: trainer hooks of the first start of these nodes (a
        stall, `faults.StallAt`), for nodes that neither crash nor crash at export.

        A world that stops with every node alive (its ranks abandoned a step or a switch: a wait ran past
        its wait bound) is re-formed by the operator (`operator/_aborts`), not by this harness:
        `run` raises `WorldStopped` naming it, rather than leaving the workers to wait out their plan
        timeout and die of it."""
        self.degree = check_supported(plan)
        if plan.global_batch != planner.job.global_batch:
            raise PlannerError(
                "global_batch", f"plan has {plan.global_batch}, the job {planner.job.global_batch}"
            )
        if upgrade_after is not None and upgrade_after < 1:
            raise ValueError(f"upgrade_after: must be >= 1 or None, got {upgrade_after}")
        if grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {grace_s}")
        self.config = config
        self.plan = plan.model_copy(update={"generation": 0})
        self.planner = planner
        self.log_dir = Path(log_dir)
        self.fail_at = dict(fail_at or {})
        self.policy = Policy(policy)
        self.upgrade_after = upgrade_after
        self.grace_s = grace_s
        self.start_method = start_method
        self.on_plan = on_plan
        self.live = live
        self.joins = dict(joins or {})
        self.publish_at = dict(publish_at or {})
        self.crash_at_export = crash_at_export
        self.hooks = dict(hooks or {})
        # live=False sends every failure down the checkpoint-restart path: the benchmark's baseline.
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.agents: dict[int, NodeAgent] = {}
        self.plans: list[Plan] = []
        self.recoveries: list[Recovery] = []
        self.failed: set[int] = set()
        self.returns: dict[int, Any] = {}
        self._upgrade_at: int | None = None
        self._announced = 0
        self._stopped_since: tuple[int, float] | None = None  # (generation, when its first abort was seen)
        self._next_abort_look = 0.0

    # ---- plans -------------------------------------------------------------------------------------------
    def publish(self, plan: Plan) -> None:
        publish_plan(self.store, plan, self._announced)
        self.plan = plan
        self.plans.append(plan)
        if self.on_plan is not None:
            self.on_plan(plan)

    def _announce(self, failed: set[int]) -> None:
        """Tell every worker at once (their waits watch this counter) that peers died."""
        if failed:
            self._announced = announce_failures(self.store, len(failed))

    def _committed(self) -> int:
        return int(self.store.add(COMMITTED_KEY, 0))

    def _fully_applied(self) -> bool:
        applied = int(self.store.add(applied_key(self.plan.generation), 0))
        return applied >= len(world_nodes(self.plan)) * self.degree

    # ---- processes ---------------------------------------------------------------------------------------
    def crash(self, node: int, restore: bool) -> StepHooks | None:
        """The trainer hooks for `node`: its crash from `fail_at` or `crash_at_export` (never after a
        restart), or none."""
        if restore:
            return None
        if node in self.crash_at_export:
            return CrashAtExport(node)
        step = self.fail_at.get(node)
        return self.hooks.get(node) if step is None else CrashAt(node, step)

    def _start(self, nodes: list[int], restore: bool) -> None:
        host, port = "127.0.0.1", self.store.port
        for node in nodes:
            agent = NodeAgent(node, self.log_dir, self.start_method)
            agent.start(
                (node, self.config, host, port, self.crash(node, restore), restore), workers=self.degree
            )
            self.agents[node] = agent

    def run(self, timeout_s: float = 120.0) -> JobResult:
        started = time.time()
        self.publish(self.plan)
        self._start(list(self.plan.nodes), restore=False)
        self._start(sorted(self.joins), restore=False)
        running = set(self.agents)
        while running:
            if time.time() - started > timeout_s:
                self.shutdown()
                raise TimeoutError(f"timeout_s: job did not finish within {timeout_s} s")
            newly_failed = self._poll(running)
            if newly_failed:
                detected = time.time()
                self._announce(newly_failed)
                time.sleep(self.grace_s)  # simultaneous failures arrive within a short window: plan once
                late = self._poll(running)
                self._announce(late)
                self._recover(frozenset(newly_failed | late), detected, running)
            elif self._upgrade_at is not None and self._committed() >= self._upgrade_at:
                self._upgrade_at = None
                self.publish(self.planner.upgrade(self.plan))
            elif self.publish_at and self._committed() >= min(self.publish_at):
                planned = self.publish_at.pop(min(self.publish_at))
                self.publish(planned.model_copy(update={"generation": self.plan.generation + 1}))
            elif joined := self._due_joins():
                for node in joined:
                    del self.joins[node]
                self.publish(self.planner.grow(self.plan, joined, self.policy))
            elif stopped := self._world_stopped():
                self.shutdown()
                raise stopped
            time.sleep(0.02)
        return self._result(time.time() - started)

    def _due_joins(self) -> list[int]:
        """New nodes whose step has come and whose workers wait to join, once the current plan is fully
        applied (not mid-switch)."""
        if not self.joins or not self._fully_applied():
            return []
        committed = self._committed()
        return sorted(
            node
            for node, step in self.joins.items()
            if committed >= step and self.store.check([joining_key(node)])
        )

    def _world_stopped(self) -> WorldStopped | None:
        """The error to end the run with once the current world's ranks abandoned its step or switch with
        every node alive, and no failure explained it within the operator's own wait for that (twice the
        plan's wait bound, `runtime.wait_bound_s`, plus a grace: `operator/_aborts`). Looked at twice a
        second."""
        now = time.monotonic()
        if now < self._next_abort_look:
            return None
        self._next_abort_look = now + 0.5
        generation = self.plan.generation
        aborted = [n for n in world_nodes(self.plan) if self.store.check([event_key("abort", generation, n)])]
        if not aborted:
            self._stopped_since = None
            return None
        if self._stopped_since is None or self._stopped_since[0] != generation:
            self._stopped_since = (generation, now)
            return None
        waited = now - self._stopped_since[1]
        bound = wait_bound_s(self.plan, self.config.collective_timeout_s)  # what the workers waited
        if waited < 2 * bound + WORLD_STOPPED_GRACE_S:
            return None
        return WorldStopped(
            f"generation {generation}: node(s) {aborted} abandoned its step or switch with every node alive "
            f"(seen {waited:.1f} s ago; a wait ran past its bound of {bound:g} s, or a connection broke). "
            f"The operator re-forms such a world; this harness does not. The workers' logs: {self.log_dir}"
        )

    def _poll(self, running: set[int]) -> set[int]:
        failed = set()
        for node in sorted(running):
            finished, is_failed, value = self.agents[node].poll()
            if finished:
                running.discard(node)
                if is_failed:
                    failed.add(node)
                else:
                    self.returns[node] = value
        self.failed |= failed
        return failed

    def _recover(self, failed: frozenset[int], detected: float, running: set[int]) -> None:
        committed = self._committed()
        begin = time.perf_counter()
        # Past the last step the workers are writing the trained model out: they take the plan in place (a
        # checkpoint plan too, as under the operator), and nothing is restarted.
        ended = committed >= self.config.steps
        # A failure in the middle of a switch may leave layers half-copied: only a restart is safe then.
        restart = not ended and (not self.live or not self._fully_applied())
        plan: Plan | None = None
        if not restart:
            try:
                plan = self.planner.recover(self.plan, failed, self.policy)
            except PlannerError:
                plan = None
            restart = not ended and (plan is None or plan.policy is Policy.CHECKPOINT)
        if ended and plan is None:
            plan = self.planner.restart(self.plan, failed)
        elif restart or plan is None:
            for node in sorted(running):
                self.agents[node].stop()
            running.clear()
            if plan is None or plan.policy is not Policy.CHECKPOINT:
                plan = self.planner.restart(self.plan, failed)
        self._upgrade_at = (
            committed + self.upgrade_after
            if plan.policy is Policy.REROUTE and self.upgrade_after is not None
            else None
        )
        planning = time.perf_counter() - begin
        plan = plan.model_copy(update={"planning_s": planning})
        self.recoveries.append(
            Recovery(
                failed=tuple(sorted(failed)),
                generation=plan.generation,
                policy=str(plan.policy),
                detected_at=detected,
                planned_at=time.time(),
                planning_s=planning,
                restarted=restart,
                committed_before=committed,
            )
        )
        self.publish(plan)
        if restart:
            self._start(list(plan.nodes), restore=True)
            running.update(plan.nodes)

    def shutdown(self) -> None:
        for agent in self.agents.values():
            agent.stop()

    # ---- results -----------------------------------------------------------------------------------------
    def _get(self, key: str) -> str | None:
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def _result(self, wall_s: float) -> JobResult:
        losses: dict[int, float] = {}
        samples: dict[int, list[int]] = {}
        for step in range(self.config.steps):
            text = self._get(loss_key(step))
            if text is not None:
                losses[step] = float(text.split(":", 1)[1])
            record = self._get(samples_key(step))
            if record:
                samples[step] = trained_samples(record)
        received: dict[int, list[tuple[int, int, int, int]]] = {}
        events: dict[str, Any] = {}
        step_times: dict[int, list[float]] = {}
        for plan in self.plans:
            text = self._get(steptime_key(plan.generation))
            step_times[plan.generation] = [float(v) for v in (text or "").split(";") if v]
            text = self._get(received_key(plan.generation))
            rows = [tuple(int(v) for v in row.split(",")) for row in (text or "").split(";") if row]
            received[plan.generation] = rows  # type: ignore[assignment]
            for node in range(max(self.plan.nodes + tuple(self.failed)) + 1):
                for kind in ("applied", "abort", "resumed"):
                    value = self._get(event_key(kind, plan.generation, node))
                    if value is not None:
                        events[f"{kind}/{plan.generation}/{node}"] = (
                            json.loads(value) if kind == "applied" else float(value)
                        )
        for node in self.failed:
            value = self._get(fail_event_key(node))
            if value is not None:
                events[f"fail/{node}"] = float(value)
        return JobResult(
            losses=losses,
            samples=samples,
            received=received,
            plans=list(self.plans),
            recoveries=list(self.recoveries),
            events=events,
            wall_s=wall_s,
            return_values=dict(self.returns),
            step_times=step_times,
        )
