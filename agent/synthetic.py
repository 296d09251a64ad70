"""A synthetic training loop for the local stack until the real training runtime runs in the pods: it
follows the published plan (this node's share of the layout, the plan's estimated step time scaled down),
honours injected slowdowns, and reports real measured iteration times through the telemetry. It keeps
stepping while Redis is away (the telemetry rides the outage out).

A node the plan does not use (parked by fail-slow mitigation S4, or joined and waiting) keeps timing probe
steps and reports them with zero samples: that is how the operator learns that a parked node recovered
(Falcon keeps profiling a replaced node for the same reason)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Hashable

from resilientjob.protocol.messages import PlanAnnouncement

from ._parked import current_order
from .telemetry import Telemetry


async def slowdown(telemetry: Telemetry) -> float:
    """The chaos factor injected for this node (`rjob local chaos slow`, a link order too: the synthetic
    loop has no links), 1.0 when none, expired or while Redis is away."""
    order = await current_order(telemetry)
    return order.factor if order is not None and order.active() else 1.0


def step_seconds(announcement: PlanAnnouncement, time_scale: float) -> float:
    """The layout's estimated step time scaled into a fast loop (bounded so that a tiny or huge model
    still gives a visible, quick step)."""
    return min(2.0, max(0.02, announcement.plan.step_time_s * time_scale))


def role_of(announcement: PlanAnnouncement, node: int) -> Hashable:
    """What this node computes under the plan: its stages' layers and its pipeline's micro-batches, or
    "probe" when the plan does not use it. The change-point detector restarts only when this changes."""
    for pipeline in announcement.plan.pipelines:
        layers = tuple(s.layers for s in pipeline.stages if s.node == node and not s.rerouted)
        if layers:
            return (layers, pipeline.microbatches)
    return "probe"


def samples_of(announcement: PlanAnnouncement, node: int) -> int | None:
    """Samples this node counts per step: its pipeline's batch share if it runs that pipeline's first stage,
    0 for the other stages (so that summing over nodes counts each sample once), None if not in the plan."""
    for pipeline in announcement.plan.pipelines:
        stages = [stage for stage in pipeline.stages if not stage.rerouted]
        if any(stage.node == node for stage in stages):
            first = stages[0].node if stages else -1
            return pipeline.microbatches * announcement.plan.microbatch_size if first == node else 0
    return None


async def train(telemetry: Telemetry, stopped: asyncio.Event, time_scale: float = 0.05) -> None:
    """Run steps for as long as `stopped` is not set, switching layouts as generations arrive."""
    current: PlanAnnouncement | None = None

    async def follow() -> None:
        nonlocal current
        async for announcement in telemetry.plan_updates(stopped):
            current = announcement

    follower = asyncio.create_task(follow())
    step = 0
    log = _ProgressLog(telemetry.node)
    try:
        while not stopped.is_set():
            plan = current
            if plan is None:
                await asyncio.sleep(0.1)  # no plan yet
                continue
            samples = samples_of(plan, telemetry.node)
            started = time.perf_counter()
            nominal, factor = step_seconds(plan, time_scale), await slowdown(telemetry)
            await asyncio.sleep(nominal * factor)
            elapsed = time.perf_counter() - started
            step += 1
            role = role_of(plan, telemetry.node)
            log.step(plan, role, step, elapsed)
            await telemetry.record_iteration(
                plan.generation, step, elapsed, samples or 0, role, chaos_s=nominal * (factor - 1)
            )
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower


class _ProgressLog:
    """What `kubectl logs` shows of a synthetic worker: a line per generation (the node's part in it) and
    one every `every_s` seconds with the steps and the mean step time since the last line."""

    def __init__(self, node: int, every_s: float = 30.0) -> None:
        self.node, self.every_s = node, every_s
        self.generation = -1
        self.since = time.monotonic()
        self.steps = 0
        self.seconds = 0.0

    def step(self, announcement: PlanAnnouncement, role: Hashable, step: int, elapsed_s: float) -> None:
        if announcement.generation != self.generation:
            self.generation = announcement.generation
            part = "not in the layout (probe steps)" if role == "probe" else f"stages/micro-batches {role}"
            print(
                f"synthetic: node {self.node} generation {announcement.generation} "
                f"({announcement.trigger}): {part}",
                flush=True,
            )
        self.steps += 1
        self.seconds += elapsed_s
        if time.monotonic() - self.since >= self.every_s:
            print(
                f"synthetic: node {self.node} step {step} generation {self.generation}: "
                f"{self.seconds / self.steps:.3f} s/step over {self.steps} steps",
                flush=True,
            )
            self.since, self.steps, self.seconds = time.monotonic(), 0, 0.0
