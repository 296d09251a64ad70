"""What a node's agent does while the plan leaves the node out: measure its device, and come back when asked.

Fail-slow mitigation S4 parks a slow node: the new generation runs without it, its worker leaves (the
runtime's worker exits when a plan has no part for its node) and its pod stays up. The operator gives the
node its place back on the node's own recovery report, so a parked node must go on measuring itself, as
Falcon keeps profiling a replaced node; when that report does not come, on its probe steps read against
the training nodes' own timings of the same product (`operator._failslow_parked`). Until a generation
takes the node back, the agent times one matrix product on each of the node's devices every
`PROBE_INTERVAL_S` (the slowest counts), stretched by the node's compute chaos order as the worker's compute
would be, and reports it as a probe step: zero samples, and a new role, so its watch (`_step_watch`) starts
over on the probe's first level and reports the recovery when the level falls under it.
When a generation takes the node back, the caller starts a new worker, which joins as a replacement node
does: the plan copies its layers to it from its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from resilientjob.protocol.chaos import ChaosOrder, parse_order
from resilientjob.protocol.messages import PlanAnnouncement

from ._device_work import DeviceWork
from ._redis import REDIS_DOWN
from .telemetry import PARKED_ROLE, Telemetry

PROBE_SIZE = 512
"""Side of the probe's square matrices on a CPU: a few milliseconds on one core."""
ACCELERATOR_PROBE_SIZE = 2048
"""The side on an accelerator: a product of 512 is a kernel launch there (~10 us, which a throttled clock
barely moves); 2048 is compute (~0.35 ms of an H100's float32 products). Not yet run on a GPU."""
PROBE_REPEATS = 5
"""Products timed per probe step, the fastest kept."""
PROBE_INTERVAL_S = 0.2
"""Between probe starts: a parked node leaves its cores to whatever else runs there."""
SETTLE_S = 3.0
"""Probing starts this long after the node was parked: right after, the job switches layouts and this node's
worker exits, and probe steps timed in that turmoil would make the detector's baseline (wall-time probes
on the local stack read 10-15x the later ones there, and the first quiet steps were reported as the node's
recovery while it was still ordered x4)."""


@dataclass(frozen=True, slots=True)
class ProbeStep:
    seconds: float
    """The probe's time, the chaos order's stretch included."""
    chaos_s: float
    """What the chaos order added (0 without one)."""


def taken_back(announcement: PlanAnnouncement | None, node: int) -> bool:
    """Whether `announcement`'s plan runs `node` again (a parked node stays out of `plan.nodes`)."""
    return announcement is not None and node in announcement.plan.nodes


async def current_order(telemetry: Telemetry) -> ChaosOrder | None:
    """This node's chaos order as stored (validated), None when none, malformed or Redis is away (the
    telemetry's outage: the heartbeat loop finds out when it is back)."""
    if telemetry.outage.down:
        return None
    try:
        raw = await telemetry.client.get(telemetry.keys.chaos(telemetry.node))
    except REDIS_DOWN as exc:
        telemetry.outage.failed(exc)
        return None
    return parse_order(raw)


async def compute_factor(telemetry: Telemetry) -> float:
    """This node's live compute chaos order (a link order slows no compute); 1.0 when none."""
    order = await current_order(telemetry)
    return order.factor if order is not None and order.link is None and order.active() else 1.0


def measure(device: str, cpu_size: int = PROBE_SIZE, repeats: int = PROBE_REPEATS) -> float:
    """Seconds of the fastest of `repeats` square matrix products on `device` (the validation pass's GEMM):
    on an accelerator `ACCELERATOR_PROBE_SIZE` wide, its wall time; on the CPU `cpu_size` wide, the thread's
    own CPU time, on one thread. A probe measures its device, not what else shares the device's cores: on
    the local stack the other nodes' workers run on the same cores, and wall time there followed their
    load, not the node's speed (a CPU that a throttle slows still takes longer in CPU time). A chaos order's
    stretch is the caller's (a parked node's agent sleeps it, a drained node's worker multiplies it in):
    sleeping it between the products also slowed the products themselves by 20-30% in CPU time, cold
    caches after each."""
    from .validation import gemm_benchmark

    if device != "cpu":
        from .worker import worker_device

        kind, _, index = device.partition(":")
        worker_device(kind, int(index or 0))  # in the probing child: torch_npu loaded, the device current
        return gemm_benchmark(ACCELERATOR_PROBE_SIZE, repeats, device, stretched=False).seconds
    import torch

    # One thread: the thread's CPU time is the product's only then (a worker's caller puts its own count
    # back, `_worker_probe`; the agent trains nothing itself, and keeps one: switching the count before
    # every probe is not how it was measured).
    torch.set_num_threads(1)
    return gemm_benchmark(cpu_size, repeats, device, clock=time.thread_time, stretched=False).seconds


async def probe(telemetry: Telemetry, devices: Sequence[str], work: DeviceWork) -> ProbeStep:
    """One probe step: the product timed on each of the node's `devices` off the event loop (`work`: off the
    agent's process on an accelerator), the slowest kept (a node of k devices is as fast as its slowest, as
    the validation pass counts it), then the chaos order's stretch slept."""
    seconds = max([await work.run(measure, device) for device in devices])
    delay = seconds * (await compute_factor(telemetry) - 1.0)
    if delay > 0:
        await asyncio.sleep(delay)
    return ProbeStep(seconds + delay, delay)


async def until_taken_back(
    telemetry: Telemetry, stopped: asyncio.Event, devices: Sequence[str], step: int
) -> PlanAnnouncement | None:
    """Probe the node's `devices` and report until a generation runs this node again (returned) or `stopped`
    (None). `step`: the node's last reported step; probe steps count on from it."""
    if not devices:
        raise ValueError("devices: a parked node probes at least one")
    work = DeviceWork(devices[0].partition(":")[0])
    try:
        return await _probe_until_taken_back(telemetry, stopped, devices, step, work)
    finally:
        work.close()  # the probing child's device context goes before the node's workers start


async def _probe_until_taken_back(
    telemetry: Telemetry, stopped: asyncio.Event, devices: Sequence[str], step: int, work: DeviceWork
) -> PlanAnnouncement | None:
    current: PlanAnnouncement | None = None
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopped.wait(), SETTLE_S)
    while not stopped.is_set():
        with contextlib.suppress(*REDIS_DOWN):  # the telemetry's own calls ride the outage out
            current = await telemetry.current_plan() or current
        if taken_back(current, telemetry.node):
            return current
        started = time.monotonic()
        measured = await probe(telemetry, devices, work)
        step += 1
        await telemetry.record_iteration(
            current.generation if current is not None else telemetry.generation,
            step,
            measured.seconds,
            0,
            PARKED_ROLE,
            compute_s=measured.seconds,
            chaos_s=measured.chaos_s,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), max(0.0, PROBE_INTERVAL_S - (time.monotonic() - started)))
    return None
